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

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

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


class _Run:
    """One W-rank exchange's inputs, and its steps run through ``mod`` (ref or tk) with the
    collectives done by hand. Each step can be handed another run's messages (``got``,
    ``every``): the kernels' steps take the reference's, so that each is compared on the
    same input (a mean summed in another order may round to another bf16 value, and the next
    phase would see another message). Outputs start as sentinels, inside guard bands."""

    def __init__(self, W, chunk, dtype, ef, seed=0):
        self.W, self.chunk, self.dtype, self.ef = W, chunk, dtype, ef
        self.plan = plan = _plan(W, chunk)
        one, two = _layouts(plan, chunk, dtype)
        self.one, self.two = one, two
        self.at, self.dense_at = one.spans["scales"][0], two.spans["dense"][0]
        self.x = [_rand(N, seed + r) for r in range(W)]
        self.e = [_rand(N, seed + 10 + r) if ef else None for r in range(W)]
        self.e2 = [_rand(N, seed + 20 + r) if ef else None for r in range(W)]

    def own(self, r):
        return slice(r * self.plan.cpr, (r + 1) * self.plan.cpr)

    def encode(self, mod, new):
        p = self.plan
        self.msg, self.msg2, self.e_next, self.e2_next = [], [], [], []
        for r in range(self.W):
            self.e_next.append(new((N,), SENTINEL) if self.ef else None)
            self.e2_next.append(new((N,), SENTINEL) if self.ef else None)
            self.msg.append(new((self.W, self.one.nbytes), 0xA5, torch.uint8))
            self.msg2.append(new((1, self.two.nbytes), 0xA5, torch.uint8))
            mod.onebit_encode(self.x[r], self.e[r], self.e_next[r], self.e2_next[r], p.starts,
                              p.reals, self.chunk, r, self.msg[r], self.at, self.dtype, p.rest,
                              onebit._dense_field(self.msg2[r], self.dense_at, p.n_dense)[0])

    def reencode(self, mod, got):
        p = self.plan
        for r in range(self.W):
            mine = torch.stack([got[s][r] for s in range(self.W)])
            mod.onebit_reencode(mine, self.e2[r], self.e2_next[r], p.starts[self.own(r)],
                                p.reals[self.own(r)], self.chunk, self.msg2[r], self.at,
                                self.dtype)

    def decode(self, mod, every, new):
        p = self.plan
        self.out = new((N,), SENTINEL)
        mod.onebit_decode(every, p.starts, p.reals, self.chunk, self.at, self.dtype, p.rest,
                          onebit._dense_field(every, self.dense_at, p.n_dense), self.out)

    def sent(self, msg, rows=None):
        """What msg's rows decode to, at the bucket's positions of their chunks (0 elsewhere):
        the rows are chunks ``rows`` (a slice; all by default)."""
        p = self.plan
        rows = rows or slice(None)
        at, real = ref.onebit_slots(p.starts[rows], p.reals[rows], self.chunk)
        v = ref._onebit_values(msg, at.shape[0] // msg.shape[0], self.chunk, self.at, self.dtype)
        out = torch.zeros(N, device=DEV)
        out[at[real]] = v[real]
        return out


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
    """Signs exact (y is the same sum in both), scales up to the sums' order, each memory
    keeping exactly what was not sent (memory + sent = the reference's), every element of
    both memories and of the bucket written, nothing outside them, the decode exact."""
    if block is not None:
        monkeypatch.setattr(tk.common, "BLOCK", block)
    want, got = _Run(W, chunk, dtype, ef), _Run(W, chunk, dtype, ef)
    new = Guarded()
    p, at, cpr = want.plan, want.at, want.plan.cpr
    nb = cpr * chunk // 8
    end = at + 4 * cpr * (2 if dtype == torch.float32 else 1)  # the scales' end
    want.encode(ref, new)
    got.encode(tk, new)
    for r in range(W):
        assert torch.equal(got.msg[r][:, :at], want.msg[r][:, :at])
        assert not got.msg[r][:, nb:at].any()  # the zero bytes before the scales
        _check_scales(want.msg[r], got.msg[r], at, cpr, dtype)
        assert torch.equal(got.msg2[r][:, end:], want.msg2[r][:, end:])  # the dense values
        if ef:
            keep = got.e_next[r] + got.sent(got.msg[r])
            torch.testing.assert_close(keep, want.e_next[r] + want.sent(want.msg[r]),
                                       rtol=2e-6, atol=1e-6)
            assert not got.e_next[r][p.rest].any()
            mine = torch.zeros(N, dtype=torch.bool, device=DEV)  # phase 2 writes those
            at_, real = ref.onebit_slots(p.starts[got.own(r)], p.reals[got.own(r)], chunk)
            mine[at_[real]] = True
            assert (got.e2_next[r][mine] == SENTINEL).all() and not got.e2_next[r][~mine].any()
    want.reencode(ref, want.msg)
    got.reencode(tk, want.msg)
    for r in range(W):
        assert torch.equal(got.msg2[r][:, :at], want.msg2[r][:, :at])
        _check_scales(want.msg2[r], got.msg2[r], at, cpr, dtype)
        if ef:
            assert (got.e2_next[r] != SENTINEL).all()
            own = got.own(r)
            keep = got.e2_next[r] + got.sent(got.msg2[r], own)
            torch.testing.assert_close(keep, want.e2_next[r] + want.sent(want.msg2[r], own),
                                       rtol=2e-6, atol=1e-6)
    every = torch.cat(want.msg2)
    want.decode(ref, every, new)
    got.decode(tk, every, new)
    new.check()
    assert torch.equal(got.out, want.out)
    assert not got.out[p.rest[p.n_dense:]].any()  # the gaps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_writes_the_guards_verdict(dtype):
    """The decode with the guard's verdict (the chunks and rest name every element of the
    bucket, gaps included, so its NaN covers the bucket): flag down, the bucket bit for bit the decode's alone; flag up, NaN
    throughout; the other flag zeroed either way, on the kernel and the reference alike."""
    run = _Run(2, 8, dtype, True)
    p = run.plan
    at, real = ref.onebit_slots(p.starts, p.reals, 8)
    assert sorted(at[real].tolist() + p.rest.tolist()) == list(range(N))
    run.encode(ref, Guarded())
    run.reencode(ref, run.msg)
    every = torch.cat(run.msg2)
    args = (every, p.starts, p.reals, 8, run.at, dtype, p.rest,
            onebit._dense_field(every, run.dense_at, p.n_dense))
    want = ref.onebit_decode(*args, torch.full((N,), SENTINEL, device=DEV))
    for mod in (ref, tk):
        for up in (0.0, 1.0):
            flag = torch.tensor([up, 3.0, -3.0], device=DEV)
            clear = torch.tensor([1.0, 4.0, -4.0], device=DEV)
            got = mod.onebit_decode(*args, torch.full((N,), SENTINEL, device=DEV),
                                    (flag, clear))
            assert clear.tolist() == [0.0, 4.0, -4.0] and flag.tolist() == [up, 3.0, -3.0]
            assert got.isnan().all() if up else torch.equal(got, want)


def test_the_steps_equal_the_definition():
    """The reference, against the exchange's definition: phase 1 quantizes each chunk's real
    elements (the padding in no mean), and the decode gives every real element its chunk's
    mean of its sign, the dense ones their average; error feedback keeps the difference."""
    W, chunk = 2, 8
    run = _Run(W, chunk, torch.float32, ef=True)
    new = Guarded()
    run.encode(ref, new)
    run.reencode(ref, run.msg)
    run.decode(ref, torch.cat(run.msg2), new)
    plan, at, msg, e_next = run.plan, run.at, run.msg[0], run.e_next[0]
    y = (run.x[0] + run.e[0]).double()
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
        torch.testing.assert_close(e_next[s : s + k].double(), v - deq, rtol=1e-6, atol=1e-6)
    # error feedback over both phases: W * the average + what both memories keep = the
    # ranks' inputs and their memories (the second one at the part each rank owns)
    lhs, rhs = W * run.out.double(), torch.zeros(N, dtype=torch.float64, device=DEV)
    for r in range(W):
        own = torch.zeros(N, dtype=torch.bool, device=DEV)
        a, real = ref.onebit_slots(plan.starts[run.own(r)], plan.reals[run.own(r)], chunk)
        own[a[real]] = True
        lhs += run.e_next[r] + W * run.e2_next[r]
        rhs += run.x[r] + run.e[r] + W * torch.where(own, run.e2[r], 0.0)
    big = torch.ones(N, dtype=torch.bool, device=DEV)
    big[plan.rest] = False
    torch.testing.assert_close(lhs[big], rhs[big], rtol=0, atol=1e-5)
    dense = torch.cat([torch.arange(o, o + k) for o, k in DENSE]).to(DEV)
    torch.testing.assert_close(run.out[dense], (run.x[0] + run.x[1])[dense] / 2)


@triton.jit
def _round_kernel(x_ptr, h_ptr, f_ptr, n, B: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    m = o < n
    h, f = tk.onebit._bf16_bits(tl.load(x_ptr + o, mask=m, other=0.0))
    tl.store(h_ptr + o, h.to(tl.int16), mask=m)
    tl.store(f_ptr + o, f, mask=m)


def test_the_kernels_bf16_rounding_is_torchs():
    """The scales' rounding to bfloat16 (integer arithmetic, the same in the interpreter):
    nearest, ties to even, as torch's cast, over 60 decades, exact ties, signed zeros,
    subnormals and the largest floats."""
    g = torch.Generator().manual_seed(0)
    mag = 10.0 ** torch.randint(-30, 30, (20000,), generator=g).float()
    ties = torch.randn(1000, generator=g).to(torch.bfloat16).float().view(torch.int32) | 0x8000
    x = torch.cat([torch.randn(20000, generator=g) * mag, ties.view(torch.float32),
                   torch.tensor([0.0, -0.0, 3.0e38, -3.0e38, 1e-40, -1e-40])]).to(DEV)
    h = torch.empty(x.numel(), dtype=torch.int16, device=DEV)
    f = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, h, f, x.numel(), B=1024)
    want = x.to(torch.bfloat16)
    assert torch.equal(h, want.view(torch.int16)) and torch.equal(f, want.float())


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
@pytest.mark.parametrize("pieces", [[(0, 100), (3, 3)], [(0, 100)], [(0, 100), (40, 100)]])
def test_the_gpu_path_takes_an_empty_shard(pieces):
    """A rank's empty piece of a sharded parameter (FSDP), alone or beside others: no chunk of
    it, the CPU path's result and memories."""
    params, off = [], 0
    for i, (numel, whole) in enumerate(pieces):
        params.append(ParamSlice(f"p{i}", (whole,), off, numel, whole=whole))
        off += numel
    res = {}
    for kernels in ("triton", "cpu"):
        os.environ["GRADCOMP_KERNELS"] = kernels
        try:
            name, cfg = gradcomp.build_config("onebit:chunk=8", warmup="none", min_numel=10)
            state = gradcomp.State(name, cfg)
            g = torch.Generator().manual_seed(0)
            outs = [state.reduce(torch.randn(off, generator=g), params) for _ in range(2)]
            res[kernels] = outs, state.state_dict()["memory"]["flat"]
            state.close()
        finally:
            os.environ["GRADCOMP_KERNELS"] = "cpu"
    for a, b in zip(res["triton"][0], res["cpu"][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res["triton"][1], res["cpu"][1], rtol=1e-5, atol=1e-5)


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


@pytest.mark.skipif(not INTERPRET, reason="drives CPU tensors down the GPU's path")
@pytest.mark.parametrize("bad", [float("nan"), -float("inf")])
def test_the_gpu_paths_non_finite_step_leaves_the_memory_alone(bad, monkeypatch):
    from test_precision import test_a_non_finite_step_propagates_and_leaves_memory_alone as check
    monkeypatch.setenv("GRADCOMP_KERNELS", "triton")
    check("onebit:chunk=64", bad)


@pytest.mark.skipif(not INTERPRET, reason="drives CPU tensors down the GPU's path")
def test_the_gpu_path_copies_neither_memory_and_takes_next_as_current(monkeypatch):
    """Both memories rewritten whole: the guard's snapshot copies neither, and a context whose
    next buffer is the current one (no double buffering) gives the same results (each kernel
    reads an element of a memory before it writes it)."""
    from gradcomp.memory import ParamMemory
    from test_precision import test_the_guard_copies_no_slot_an_exchange_rewrites_whole as check
    monkeypatch.setenv("GRADCOMP_KERNELS", "triton")
    copied = []
    real = ParamMemory._cover
    monkeypatch.setattr(ParamMemory, "_cover",
                        lambda self, snap, s: (copied.append(s), real(self, snap, s))[1])
    check("onebit:chunk=64", monkeypatch)
    assert "server_residual" not in copied


def _two_ranks(rank, world, spec):
    from test_triton_path import _run
    return _run(rank, world, spec, steps=3, min_numel=None)


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
        (ob._onebit_decode_kernel, ["*u8", s, "*i64", "*i32", P, "*i64", P, P, P] + [I] * 9
         + ["fp32", I], dict(HALF=half, ROWS=rows, BYTES=width, RBLOCK=2048, HAS_FLAG=half))]
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
