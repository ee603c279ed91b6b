"""1-bit SGD's GPU path: its three steps (kernels.onebit_encode, _reencode, _decode), one launch
each per bucket, against their reference, and the exchange built on them against the CPU's.

The GPU path reads and writes the bucket where it lies, chunk by chunk through the slot
tables (compressors/onebit.py's ``_slots``), where the CPU path copies the bucket into the
part layout and back (``_Parts``): the tables must name the same elements as those copies.
Without a GPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, conftest.py)
and ``GRADCOMP_KERNELS=triton`` sends CPU tensors down the GPU's path; on a GPU machine the
same file runs the compiled kernels."""
import math
import os

import pytest
import torch
import torch.distributed as dist

triton = pytest.importorskip("triton")

import gradcomp  # noqa: E402
from conftest import SHAPES, layout  # noqa: E402
from gradcomp.compressors import onebit  # noqa: E402
from gradcomp.compressors.base import ParamSlice  # noqa: E402
from gradcomp.kernels import reference as ref  # noqa: E402
from gradcomp.kernels import triton as tk  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEV = "cpu" if INTERPRET else "cuda"
SENTINEL = 1234.5

# (compressed, dense) parameters of a bucket of N elements: partly filled last chunks, a
# parameter smaller than a chunk (at W > 1 whole parts of padding), dense ones before, between
# and after, and elements of no parameter (gaps: written 0)
N = 2400
BIG = ((0, 700), (705, 64), (800, 1000), (1830, 3), (1840, 515))
DENSE = ((700, 5), (1805, 20), (2360, 30))


def _plan(W, chunk, big=BIG, dense=DENSE, n=N):
    return onebit._slots(big, dense, n, W, chunk, torch.device(DEV))


def _layouts(plan, chunk, dtype):
    first, second = (onebit.PART16, onebit.OWNED16) if dtype == torch.bfloat16 else \
        (onebit.PART, onebit.OWNED)
    one = first.bind(part=plan.part, chunk=chunk)
    two = second.bind(part=plan.part, chunk=chunk, n_dense=plan.n_dense)
    return one, two


def _rand(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(DEV)


class Guarded:
    """Outputs inside larger buffers of the same sentinel: what a step does not write shows,
    and so does a write past an output's ends (:meth:`check`)."""

    MARGIN = 64

    def __init__(self):
        self.bufs = []

    def __call__(self, shape, fill, dtype=torch.float32):
        n = math.prod(shape)
        buf = torch.full((n + 2 * self.MARGIN,), fill, dtype=dtype, device=DEV)
        self.bufs.append((buf, n, fill))
        return buf[self.MARGIN : self.MARGIN + n].view(shape)

    def check(self):
        for buf, n, fill in self.bufs:
            assert (buf[: self.MARGIN] == fill).all() and (buf[self.MARGIN + n :] == fill).all()


def _exchange(mod, W, chunk, dtype, ef, seed=0):
    """The three steps of every rank of a W-rank exchange through ``mod`` (ref or tk), the
    collectives done by hand: (each rank's (message, phase-2 message, residual next, second
    memory next), the bucket decoded). Outputs start as sentinels, inside guard bands."""
    plan = _plan(W, chunk)
    one, two = _layouts(plan, chunk, dtype)
    at, dense_at = one.spans["scales"][0], two.spans["dense"][0]
    ranks = []
    new = Guarded()
    for r in range(W):
        x = _rand(N, seed + r)
        e = _rand(N, seed + 10 + r) if ef else None
        e_next = new((N,), SENTINEL) if ef else None
        e2_next = new((N,), SENTINEL) if ef else None
        msg = new((W, one.nbytes), 0xA5, torch.uint8)
        msg2 = new((1, two.nbytes), 0xA5, torch.uint8)
        mod.onebit_encode(x, e, e_next, e2_next, plan.starts, plan.reals, chunk, r, msg, at, dtype,
                          plan.rest, onebit._dense_field(msg2, dense_at, plan.n_dense)[0])
        ranks.append([msg, msg2, e_next, e2_next])
    for r in range(W):
        got = torch.stack([ranks[s][0][r] for s in range(W)])
        own = slice(r * plan.cpr, (r + 1) * plan.cpr)
        e2 = _rand(N, seed + 20 + r) if ef else None
        mod.onebit_reencode(got, e2, ranks[r][3], plan.starts[own], plan.reals[own], chunk,
                            ranks[r][1], at, dtype)
    every = torch.cat([m[1] for m in ranks])
    out = new((N,), SENTINEL)
    mod.onebit_decode(every, plan.starts, plan.reals, chunk, at, dtype, plan.rest,
                      onebit._dense_field(every, dense_at, plan.n_dense), out)
    new.check()
    return ranks, out, plan, at


def _check_scales(a, b, at, cpr, dtype):
    sa = ref.onebit_field(a, at, 2 * cpr, dtype).float()
    sb = ref.onebit_field(b, at, 2 * cpr, dtype).float()
    if dtype == torch.bfloat16:  # the same fp32 mean, within a few ulps, may round apart
        torch.testing.assert_close(sa, sb, rtol=2 ** -7, atol=1e-6)
    else:
        torch.testing.assert_close(sa, sb, rtol=1e-5, atol=1e-6)


# a block of 128 elements: many programs, and chunks of 136 longer than a block
@pytest.mark.parametrize("block,W", [(None, 1), (None, 2), (None, 3), (128, 2)])
@pytest.mark.parametrize("chunk,dtype", [(8, torch.float32), (24, torch.bfloat16),
                                         (64, torch.float32), (136, torch.bfloat16)])
@pytest.mark.parametrize("ef", [True, False])
def test_the_exchange_steps_match_their_reference(monkeypatch, block, W, chunk, dtype, ef):
    if block is not None:
        monkeypatch.setattr(tk.common, "BLOCK", block)
    want, want_out, plan, at = _exchange(ref, W, chunk, dtype, ef)
    got, got_out, _, _ = _exchange(tk, W, chunk, dtype, ef)
    nb = plan.cpr * chunk // 8
    for (m, m2, e, e2), (gm, gm2, ge, ge2) in zip(want, got):
        assert torch.equal(gm[:, :at], m[:, :at])  # the signs of y = x + e: exact in both
        assert not gm[:, nb:at].any()  # the zero bytes before the scales
        _check_scales(m, gm, at, plan.cpr, dtype)
        assert torch.equal(gm2[:, :at], m2[:, :at])
        _check_scales(m2, gm2, at, plan.cpr, dtype)
        assert torch.equal(gm2[:, at + 4 * plan.cpr * (2 if dtype == torch.float32 else 1):],
                           m2[:, at + 4 * plan.cpr * (2 if dtype == torch.float32 else 1):])
        if ef:  # both memories written whole: no sentinel left
            assert (ge != SENTINEL).all() and (ge2 != SENTINEL).all()
            torch.testing.assert_close(ge, e, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ge2, e2, rtol=1e-5, atol=1e-5)
            assert not ge[plan.rest].any() and not ge2[plan.rest].any()
    assert (got_out != SENTINEL).all()
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
    d = plan.rest[: plan.n_dense]  # the dense average: the same sums, in rank order
    assert torch.equal(got_out[d], want_out[d])
    assert not got_out[plan.rest[plan.n_dense:]].any()  # the gaps


def test_the_steps_equal_the_definition():
    """The reference, against the exchange's definition: phase 1 quantizes each chunk's real
    elements (the padding in no mean), the decode gives back every real element its chunk's
    mean of its sign, and error feedback keeps the difference."""
    W, chunk = 2, 8
    ranks, out, plan, at = _exchange(ref, W, chunk, torch.float32, ef=True)
    x, e = _rand(N, 0), _rand(N, 10)
    y = (x + e).double()
    msg, _, e_next, _ = ranks[0]
    bits = ref.unpack_bits(msg[:, : plan.cpr * chunk // 8]).reshape(-1, chunk)
    scales = ref.onebit_field(msg, at, 2 * plan.cpr, torch.float32).view(W, 2, -1)
    scales = scales.transpose(0, 1).reshape(2, -1)
    for c in range(plan.starts.numel()):
        s, k = int(plan.starts[c]), int(plan.reals[c])
        v = y[s : s + k]
        assert bits[c, :k].tolist() == (v >= 0).tolist() and bits[c, k:].all()
        for which, sel in ((0, v >= 0), (1, v < 0)):
            want = v[sel].mean() if sel.any() else torch.zeros((), dtype=torch.float64)
            torch.testing.assert_close(scales[which, c].double(), want, rtol=1e-6, atol=1e-7)
        deq = torch.where(v >= 0, scales[0, c], scales[1, c]).double()
        torch.testing.assert_close(e_next[s : s + k].double(), v - deq, rtol=0, atol=1e-6)
    dense = torch.cat([torch.arange(o, o + k) for o, k in DENSE])
    torch.testing.assert_close(out[dense], (_rand(N, 0) + _rand(N, 1))[dense] / 2)


@pytest.mark.parametrize("W,rank", [(1, 0), (2, 1), (3, 0), (5, 3)])
@pytest.mark.parametrize("chunk", [8, 64])
def test_the_slot_chunks_name_the_part_layouts_elements(W, rank, chunk):
    """Slot chunk c holds what the CPU path's copy into the part layout puts at c * chunk ..:
    the bucket's elements starts[c] .., then padding; ``rest`` is every other element, the
    dense parameters' first (the message's dense field, in their order)."""
    parts = onebit._parts(BIG, N, W, rank, chunk, torch.device("cpu"))
    plan = onebit._slots(BIG, DENSE, N, W, chunk, torch.device("cpu"))
    assert plan.part == parts.part and plan.starts.numel() == W * plan.cpr
    x = torch.arange(1, N + 1, dtype=torch.float32)  # every element its own nonzero value
    spread = parts.spread(x, "t.slots")[:-1].view(-1, chunk)
    at, real = ref.onebit_slots(plan.starts, plan.reals, chunk)
    assert torch.equal(torch.where(real, x[at], 0.0), spread)
    named = torch.cat([at[real], plan.rest]).sort().values
    assert torch.equal(named, torch.arange(N))  # each element once
    assert plan.rest[: plan.n_dense].tolist() == [i for o, k in DENSE for i in range(o, o + k)]
    own = slice(rank * plan.cpr, (rank + 1) * plan.cpr)
    mine = parts.own_part(x, torch.empty(parts.part))
    assert torch.equal(torch.where(real[own], x[at[own]], 0.0).view(-1), mine)


# ----------------------------------------------------------------------- the exchange itself
def _reduce(spec, kernels, steps=3, names=("fc.weight", "fc.bias", "conv.weight"), **kw):
    os.environ["GRADCOMP_KERNELS"] = kernels
    try:
        name, cfg = gradcomp.build_config(spec, warmup="none", **kw)
        state = gradcomp.State(name, cfg)
        g = torch.Generator().manual_seed(1)
        params = layout(list(names))
        outs = []
        for _ in range(steps):
            x = torch.randn(sum(p.numel for p in params), generator=g)
            outs.append(state.reduce(x.clone(), params))
        memory = state.state_dict()["memory"]["flat"]
        sent = state.stats()["sent_bytes"]
        state.close()
        return outs, memory, sent
    finally:
        os.environ["GRADCOMP_KERNELS"] = "cpu"


@pytest.mark.skipif(not INTERPRET, reason="drives CPU tensors down the GPU's path")
@pytest.mark.parametrize("spec,min_numel", [("onebit:chunk=64", 0),
                                            ("onebit:chunk=64,scales=bfloat16", 100),
                                            ("onebit:chunk=8,error_feedback=false", 100),
                                            ("onebit", 0)])
def test_the_gpu_path_gives_the_cpu_paths_exchange(spec, min_numel):
    """One rank, several steps: the same averages and memories up to rounding (the scales'
    sums run in another order), the same bytes on the wire."""
    got, got_mem, got_sent = _reduce(spec, "triton", min_numel=min_numel)
    want, want_mem, want_sent = _reduce(spec, "cpu", min_numel=min_numel)
    assert got_sent == want_sent
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got_mem.keys() == want_mem.keys()
    for slot in want_mem:
        for n in want_mem[slot]:
            torch.testing.assert_close(got_mem[slot][n], want_mem[slot][n], rtol=1e-5, atol=1e-5)
    if "error_feedback=false" not in spec:
        assert {"residual", "server_residual"} <= got_mem.keys()


@pytest.mark.skipif(not INTERPRET, reason="drives CPU tensors down the GPU's path")
@pytest.mark.parametrize("n", [300, 257, 129])
def test_the_gpu_paths_partly_filled_chunks_count_their_real_elements(n, monkeypatch):
    from test_methods import test_onebit_scales_of_a_partly_filled_chunk_count_its_real_elements
    monkeypatch.setenv("GRADCOMP_KERNELS", "triton")
    test_onebit_scales_of_a_partly_filled_chunk_count_its_real_elements(n)


@pytest.mark.skipif(not INTERPRET, reason="drives CPU tensors down the GPU's path")
def test_the_gpu_paths_failed_exchange_leaves_the_memory_as_it_was(monkeypatch):
    """Both memories rewritten whole into their next buffers: an exchange that raises at its
    last collective keeps the old ones, with nothing for the guard to copy."""
    from test_methods import (
        test_an_exchange_whose_last_collective_raises_leaves_the_memory_as_it_was as check,
    )
    check("onebit", "triton", monkeypatch)


def _two_ranks(rank, world, spec):
    name, cfg = gradcomp.build_config(spec, warmup="none")
    state = gradcomp.State(name, cfg, group=dist.group.WORLD)
    names = list(SHAPES)
    g = torch.Generator().manual_seed(10 + rank)
    total = {n: torch.zeros(math.prod(s), dtype=torch.float64) for n, s in SHAPES.items()}
    sent = {n: torch.zeros_like(v) for n, v in total.items()}
    outs = []
    for step in range(3):
        params = layout(names if step % 2 else names[::-1])
        x = torch.randn(sum(p.numel for p in params), generator=g)
        out = state.reduce(x.clone(), params)
        outs.append(out)
        for p in params:
            total[p.name] += x[p.offset : p.offset + p.numel].double()
            sent[p.name] += out[p.offset : p.offset + p.numel].double()
    return outs, total, sent, state.state_dict()["memory"]["flat"]


@pytest.mark.skipif(not INTERPRET, reason="drives CPU tensors down the GPU's path")
def test_the_gpu_path_on_two_ranks_with_dense_parameters_and_bf16_scales(spawn):
    """Two ranks, bf16 scales, a parameter under min_numel riding along dense (the decode's
    average of it): every gradient conserved (error feedback), the ranks agree, the CPU
    path's result up to rounding."""
    spec = "onebit:chunk=64,scales=bfloat16,min_numel=100"
    runs = {k: spawn(_two_ranks, 2, args=(spec,), timeout=240,
                     env={"GRADCOMP_KERNELS": k, "TRITON_INTERPRET": "1"})
            for k in ("triton", "cpu")}
    got = runs["triton"]
    for a, b in zip(got[0][0], got[1][0]):
        assert torch.equal(a, b)
    for n in SHAPES:
        inputs = sum(r[1][n] for r in got)
        kept = sum(w * r[3][slot][n].double() for r in got
                   for slot, w in (("residual", 1), ("server_residual", 2)))
        torch.testing.assert_close(2 * got[0][2][n] + kept, inputs, atol=1e-4, rtol=1e-5)
    assert not got[0][3]["residual"]["fc.bias"].any()  # dense: no error kept
    for a, b in zip(got[0][0], runs["cpu"][0][0]):  # bf16 scales may round apart: 1 ulp
        torch.testing.assert_close(a, b, atol=1e-5, rtol=2 ** -7)


# ----------------------------------------------------------------------- native build
_COMPILE = r"""
import sys
import triton
import triton.backends
from triton.backends.compiler import GPUTarget
if "nvidia" not in triton.backends.backends:
    sys.exit(3)
from gradcomp.kernels.triton import onebit as ob
P, C, I = "*fp32", "constexpr", "i32"
enc = [P, P, P, P, "*i64", "*i32", "*u8"]
specs = []
for half, long_, rows, width in ((False, False, 8, 32), (True, True, 1, 256), (False, False, 256, 1)):
    s = "*i16" if half else P
    specs += [
        (ob._onebit_encode_kernel, enc + [s, "*i64", P] + [I] * 10,
         dict(HAS_RES=not half, HAS_SERVER=True, HALF=half, LONG=long_, ROWS=rows, BYTES=width, RBLOCK=2048)),
        (ob._onebit_reencode_kernel, ["*u8", s, P, P, "*i64", "*i32", "*u8", s] + [I] * 6 + ["fp32"],
         dict(HAS_RES=half, HALF=half, LONG=long_, ROWS=rows, BYTES=width)),
        (ob._onebit_decode_kernel, ["*u8", s, "*i64", "*i32", P, "*i64", P] + [I] * 9 + ["fp32", I],
         dict(HALF=half, ROWS=rows, BYTES=width, RBLOCK=2048))]
for fn, types, cx in specs:
    sig = dict(zip(fn.arg_names, types + [C] * (len(fn.arg_names) - len(types))))
    triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cx),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print("compiled", len(specs))
"""


@pytest.mark.skipif(not INTERPRET, reason="natively the kernels are compiled by the tests above")
def test_the_steps_compile_for_a_gpu():
    """The interpreter accepts some programs the compiler rejects: each step's kernel, in its
    variants, built down to an sm_90 cubin (no GPU needed)."""
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                       text=True, timeout=300)
    if r.returncode == 3:
        pytest.skip("Triton's CUDA backend is not installed")
    assert r.returncode == 0, r.stderr[-3000:]
