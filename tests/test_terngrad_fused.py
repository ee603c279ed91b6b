"""TernGrad's fused Triton path (no error feedback: statistics, encoder and decoder reading and
writing the bucket itself, the message's codes five a byte) against the CPU path, bit for bit.

``GRADCOMP_KERNELS=triton`` with ``TRITON_INTERPRET=1`` sends CPU tensors down the path a GPU
takes (its statistics excepted: on CPU tensors they are the CPU's, so the two paths must agree
exactly); two ranks, layers whose sizes are multiples of neither 4 nor 5, parameters sent dense
beside compressed ones, a relayout, shared and per-rank scalers, clipping on and off."""
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")

import gradcomp  # noqa: E402
from conftest import lay_out  # noqa: E402

SHAPES = [("a", (7, 3)), ("b", (5,)), ("c", (33,)), ("d", (10, 13)), ("e", (2,)), ("f", (41,))]
SPECS = ["terngrad", "terngrad:share_scalers=false", "terngrad:clip=0"]
STEPS = 3


def _run(rank, world, spec):
    name, cfg = gradcomp.build_config(spec, min_numel=30, warmup="none")
    state = gradcomp.State(name, cfg, group=dist.group.WORLD)
    g = torch.Generator().manual_seed(10 + rank)
    outs = []
    for step in range(STEPS):
        params = lay_out(SHAPES if step % 2 else SHAPES[::-1])
        x = torch.randn(sum(p.numel for p in params), generator=g) * (step + 1)
        outs.append(state.reduce(x, params).clone())
    return outs


def _both_ranks(spawn, spec, kernels):
    env = {"GRADCOMP_KERNELS": kernels, "TRITON_INTERPRET": "1"}
    return spawn(_run, 2, args=(spec,), timeout=240, env=env)


@pytest.mark.parametrize("spec", SPECS)
def test_fused_path_gives_the_cpu_paths_bits(spec, spawn):
    got = _both_ranks(spawn, spec, "triton")
    want = _both_ranks(spawn, spec, "cpu")
    for rank in range(2):
        for a, b in zip(got[rank], want[rank]):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(got[0], got[1]):
        assert torch.equal(a, b)


def test_fused_path_one_rank(monkeypatch):
    """The same with one process (no process group), every tensor dense or compressed."""
    outs = {}
    for kernels in ("triton", "cpu"):
        monkeypatch.setenv("GRADCOMP_KERNELS", kernels)
        for min_numel in (0, 30, 1000):
            name, cfg = gradcomp.build_config("terngrad", min_numel=min_numel, warmup="none")
            state = gradcomp.State(name, cfg)
            g = torch.Generator().manual_seed(3)
            for step in range(2):
                params = lay_out(SHAPES)
                x = torch.randn(sum(p.numel for p in params), generator=g)
                outs.setdefault((min_numel, step), []).append(state.reduce(x, params).clone())
    for a, b in outs.values():
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
