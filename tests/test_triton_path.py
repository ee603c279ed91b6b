"""The compressors driven through the Triton kernels, as they run on a GPU.

On CUDA tensors every compressor calls the Triton kernels instead of the torch reference.
Here ``GRADCOMP_KERNELS=triton`` with ``TRITON_INTERPRET=1`` sends CPU tensors down that same
path, so the calls the compressors make (shapes, strides, dtypes, several ranks' messages)
are checked on every CI run: the kernels' own tests (test_kernels.py) cannot see how the
compressors call them. With 2 ranks, for every method that uses a kernel:
  * error feedback conserves every gradient: over the steps, the sum of all ranks' gradients
    equals W x the sum of the averages plus what the ranks' memories still hold (a wrong
    scale, a misplaced part or a dropped message breaks it);
  * ranks get identical averages;
  * deterministic methods (top-k, DGC, 1-bit, threshold) give the reference path's result up to
    rounding (TernGrad draws its uniforms from another generator on this path: Philox).
"""
import math

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")

import gradcomp  # noqa: E402
from conftest import SHAPES, layout  # noqa: E402

SPECS = ["topk:ratio=0.05", "dgc:ratio=0.05", "onebit:chunk=64", "terngrad:error_feedback=true",
         "terngrad:share_scalers=false,error_feedback=true", "threshold:max_ratio=0.05"]
STEPS = 4


def _run(rank, world, spec, steps=STEPS, min_numel=0):
    """``steps`` compressed exchanges of a bucket laid out anew each step: (the results, each
    parameter's input and result summed over them, the memory). ``min_numel``: the option,
    or None for the spec's own."""
    opts = {} if min_numel is None else {"min_numel": min_numel}
    name, cfg = gradcomp.build_config(spec, warmup="none", **opts)
    state = gradcomp.State(name, cfg, group=dist.group.WORLD)
    names = list(SHAPES)
    g = torch.Generator().manual_seed(10 + rank)
    total = {n: torch.zeros(math.prod(s), dtype=torch.float64) for n, s in SHAPES.items()}
    sent = {n: torch.zeros_like(v) for n, v in total.items()}
    outs = []
    for step in range(steps):
        params = layout(names if step % 2 else names[::-1])  # a relayout as well
        x = torch.randn(sum(p.numel for p in params), generator=g)
        out = state.reduce(x.clone(), params)
        outs.append(out)
        for p in params:
            total[p.name] += x[p.offset : p.offset + p.numel].double()
            sent[p.name] += out[p.offset : p.offset + p.numel].double()
    return outs, total, sent, state.state_dict()["memory"]["flat"]


def _both_ranks(spawn, spec, kernels):
    env = {"GRADCOMP_KERNELS": kernels, "TRITON_INTERPRET": "1"}
    return spawn(_run, 2, args=(spec,), timeout=240, env=env)


@pytest.mark.parametrize("spec", SPECS)
def test_compressors_through_the_triton_kernels_on_two_ranks(spec, spawn):
    got = _both_ranks(spawn, spec, "triton")
    W = len(got)
    for a, b in zip(got[0][0], got[1][0]):
        assert torch.equal(a, b)  # every rank gets the same average
    for n in SHAPES:
        inputs = sum(r[1][n] for r in got)
        # a rank's own residual is in its gradient's units; 1-bit's second-stage residual
        # (of the averaged part the rank owns) is in the average's: it counts W times
        kept = sum(w * r[3][slot][n].double() for r in got
                   for slot, w in (("residual", 1), ("accumulation", 1), ("server_residual", W))
                   if slot in r[3])
        torch.testing.assert_close(W * got[0][2][n] + kept, inputs, atol=1e-4, rtol=1e-5)
    if spec.startswith("terngrad"):
        return
    want = _both_ranks(spawn, spec, "reference")
    for a, b in zip(got[0][0], want[0][0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
