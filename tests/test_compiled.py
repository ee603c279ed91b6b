"""The torch.compile'd steps (gradcomp.kernels.compiled) against the reference: 1-bit below,
TernGrad at the end. Both bit-identical: the dispatcher picks the compiled path by a bucket's
size, so any difference would make a parameter's result depend on its bucket neighbours.

Compiling costs tens of seconds per graph; the suite compiles chunk 256 once per process
(encode with and without a residual, decode with one message and with several) and every
size reuses those graphs (dynamic sizes).
"""
import math
import warnings

import pytest
import torch

import gradcomp
from gradcomp import kernels
from gradcomp.compressors.base import ParamSlice
from gradcomp.kernels import compiled, cpu
from gradcomp.kernels import reference as ref

CHUNK = 256
# chunk counts: a power of two, odd, prime, and one past MIN_NUMEL's
SIZES = [CHUNK * c for c in (512, 515, 1031, 4099)]


@pytest.fixture(scope="module", autouse=True)
def compiler():
    if compiled.compiler_missing():
        pytest.skip(compiled.compiler_missing())


@pytest.fixture(autouse=True)
def no_fallback():
    """A test that silently fell back to the cpu path would compare the cpu path."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield
    assert compiled.compiler_missing() is None


def values(n, seed):
    """Gaussian values with exact zeros, negative zeros and whole chunks of one sign."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[::7] = 0.0
    x[3::11] = -0.0
    x[:CHUNK] = x[:CHUNK].abs()
    x[CHUNK : 2 * CHUNK] = -x[CHUNK : 2 * CHUNK].abs()
    return x


@pytest.mark.parametrize("with_residual", [True, False])
def test_onebit_compress_matches_the_reference(with_residual):
    for i, n in enumerate(SIZES):
        assert n >= compiled.MIN_NUMEL
        x = values(n, i)
        r = values(n, 100 + i) * 0.1 if with_residual else None
        r_ref = None if r is None else r.clone()
        bits, scales = compiled.onebit_compress(x, r, CHUNK)
        want_bits, want_scales = ref.onebit_compress(x, r_ref, CHUNK)
        assert torch.equal(bits, want_bits), n
        assert torch.equal(scales, want_scales), n  # the same sums in the same order
        if with_residual:
            assert torch.equal(r, r_ref), n


@pytest.mark.parametrize("W", [1, 2, 3])
def test_onebit_decompress_matches_the_reference(W):
    for i, n in enumerate(SIZES):
        g = torch.Generator().manual_seed(i)
        bits = torch.randint(0, 256, (W, n // 8), generator=g, dtype=torch.uint8)
        scales = torch.randn(W, 2, n // CHUNK, generator=g)
        out = torch.randn(n, generator=g)
        want = ref.onebit_decompress(bits, scales, CHUNK, out.clone(), 1 / W)
        blocked = cpu.onebit_decompress(bits, scales, CHUNK, out.clone(), 1 / W)
        got = compiled.onebit_decompress(bits, scales, CHUNK, out, 1 / W)
        assert got is out
        assert torch.equal(got, want) and torch.equal(got, blocked)
        # out not read: the result of a zero out, -0.0 as +0.0, whatever out held
        fresh = torch.full((n,), float("nan"))
        got = compiled.onebit_decompress(bits, scales, CHUNK, fresh, 1 / W, accumulate=False)
        want = cpu.onebit_decompress(bits, scales, CHUNK, torch.zeros(n), 1 / W)
        assert torch.equal(got, want) and not torch.signbit(got[got == 0]).any()
        # non-finite scales: the reference's selection (no 0 * inf), as the blocked path does
        scales[0, 0, 1], scales[0, 1, 2], scales[W - 1, 0, 3] = math.inf, -math.inf, math.nan
        got = compiled.onebit_decompress(bits, scales, CHUNK, out.clone(), 1 / W)
        want = cpu.onebit_decompress(bits, scales, CHUNK, out.clone(), 1 / W)
        assert got.isnan().any() and got.isinf().any()
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # bit for bit


def test_a_chunk_gets_the_same_scales_at_every_size(monkeypatch):
    """The dispatcher runs this path from MIN_NUMEL elements up and the cpu path below: one
    parameter's chunks, encoded alone (small) or inside a large bucket, are the same bits."""
    monkeypatch.setenv("GRADCOMP_KERNELS", "auto")
    n = SIZES[1]
    x, r = values(n, 11), values(n, 12) * 0.1
    alone = slice(7 * CHUNK, 12 * CHUNK)
    r_small = r[alone].clone()
    assert kernels.backend("onebit_compress", x) == "compiled"
    assert kernels.backend("onebit_compress", x[alone]) == "cpu"
    bits, scales = kernels.onebit_compress(x, r, CHUNK)
    bits_a, scales_a = kernels.onebit_compress(x[alone].clone(), r_small, CHUNK)
    assert torch.equal(bits[7 * CHUNK // 8 : 12 * CHUNK // 8], bits_a)
    assert torch.equal(scales[:, 7:12], scales_a)
    assert torch.equal(r[alone], r_small)


def test_deterministic():
    n = SIZES[1]
    x, r = values(n, 1), values(n, 2)
    a_r, b_r = r.clone(), r.clone()
    a = compiled.onebit_compress(x, a_r, CHUNK)
    b = compiled.onebit_compress(x, b_r, CHUNK)
    assert all(torch.equal(u, v) for u, v in zip(a, b)) and torch.equal(a_r, b_r)
    bits = torch.stack([a[0], a[0].flip(0)])
    scales = torch.stack([a[1], -a[1]])
    out = [compiled.onebit_decompress(bits, scales, CHUNK, x.clone(), 0.5) for _ in range(2)]
    assert torch.equal(out[0], out[1])


def test_dispatch(monkeypatch):
    big, small = torch.randn(compiled.MIN_NUMEL), torch.randn(compiled.MIN_NUMEL - CHUNK)
    monkeypatch.setenv("GRADCOMP_KERNELS", "auto")
    assert kernels.backend("onebit_compress", big) == "compiled"
    assert kernels.backend("onebit_decompress", big) == "compiled"
    assert kernels.backend("onebit_compress", small) == "cpu"
    assert kernels.backend("ternary_compress", big) == "compiled"
    assert kernels.backend("ternary_compress", small) == "reference"
    assert kernels.backend("ternary_decompress", big) == "compiled"
    assert kernels.backend("onebit_compress", big.double()) == "cpu"  # which hands it on
    assert kernels.backend("select_topk", big) == "reference"
    monkeypatch.setenv("GRADCOMP_KERNELS", "cpu")  # what conftest sets for the other tests
    assert kernels.backend("onebit_compress", big) == "cpu"


@pytest.mark.parametrize("how", ["no compiler", "compile fails"])
def test_fallback_warns_once_and_runs_the_cpu_path(monkeypatch, how):
    monkeypatch.setattr(compiled, "_failed", None)
    if how == "no compiler":
        monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    else:
        def broken(step, chunk):
            raise RuntimeError("simulated: no C++ compiler")
        monkeypatch.setattr(compiled, "_compiled", broken)
    monkeypatch.setenv("GRADCOMP_KERNELS", "auto")
    n = SIZES[0]
    x = values(n, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [kernels.onebit_compress(x, None, CHUNK) for _ in range(3)]
        # the decoder is not dispatched here, but falls back the same way
        dec = compiled.onebit_decompress(got[0][0].unsqueeze(0), got[0][1].unsqueeze(0), CHUNK,
                                         torch.zeros(n))
        assert kernels.backend("onebit_compress", x) == "cpu"
    assert len([w for w in caught if "compiled CPU path is off" in str(w.message)]) == 1
    want = ref.onebit_compress(x, None, CHUNK)
    for bits, scales in got:  # the cpu path: bit-identical to the reference
        assert torch.equal(bits, want[0]) and torch.equal(scales, want[1])
    assert torch.equal(dec, ref.onebit_decompress(want[0].unsqueeze(0), want[1].unsqueeze(0),
                                                  CHUNK, torch.zeros(n)))
    monkeypatch.undo()  # the module's real state back before no_fallback checks it


def test_a_residual_update_that_fails_to_compile_is_finished_eagerly(monkeypatch):
    """The 1-bit encoder's statistics have written y = x + residual into the residual when
    the feedback pass fails to compile: the residual is finished by the same arithmetic
    eagerly (not encoded again from y, which would add x twice), one warning."""
    monkeypatch.setattr(compiled, "_failed", None)
    real = compiled._compiled

    def broken_feedback(step, chunk):
        if step == "feedback":
            raise RuntimeError("simulated: the feedback pass does not compile")
        return real(step, chunk)

    monkeypatch.setattr(compiled, "_compiled", broken_feedback)
    n = SIZES[1]
    x, r = values(n, 5), values(n, 6) * 0.1
    r_ref = r.clone()
    want = ref.onebit_compress(x, r_ref, CHUNK)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bits, scales = compiled.onebit_compress(x, r, CHUNK)
    assert len([w for w in caught if "compiled CPU path is off" in str(w.message)]) == 1
    assert torch.equal(bits, want[0])
    assert torch.equal(scales, want[1]) and torch.equal(r, r_ref)
    monkeypatch.undo()


def reduce_on_both_paths(monkeypatch, spec, shapes, step):
    """gradcomp.State.reduce of ``spec`` (world size 1, three steps) on the cpu path and
    through the dispatcher's compiled path: (cpu outputs + memory, compiled ones), after
    checking the compiled ``step`` ran."""
    params, off = [], 0
    for name, s in shapes.items():
        params.append(ParamSlice(name, s, off, math.prod(s)))
        off += math.prod(s)
    calls = []
    real = compiled._run
    monkeypatch.setattr(compiled, "_run", lambda *a: calls.append(a[0]) or real(*a))
    outs = {}
    for mode in ("cpu", "auto"):
        monkeypatch.setenv("GRADCOMP_KERNELS", mode)
        name, cfg = gradcomp.build_config(spec, min_numel=0, warmup="none")
        state = gradcomp.State(name, cfg)
        g = torch.Generator().manual_seed(0)
        outs[mode] = [state.reduce(torch.randn(off, generator=g), params) for _ in range(3)]
        outs[mode].append(state.state_dict()["memory"]["flat"]["residual"])
    assert step in calls
    return outs["cpu"], outs["auto"]


def test_reduce_on_the_compiled_path_matches_the_cpu_path(monkeypatch):
    """gradcomp.State.reduce with onebit, world size 1, through the dispatcher."""
    shapes = {"a": (384, 512), "b": (1000,), "c": (64, 64, 3, 3)}
    cpu_path, auto = reduce_on_both_paths(monkeypatch, f"onebit:chunk={CHUNK}", shapes, "stats")
    for a, b in zip(cpu_path[:-1], auto[:-1]):
        assert torch.equal(b, a)
    for n in shapes:
        assert torch.equal(auto[-1][n], cpu_path[-1][n])


# --------------------------------------------------------------------------- TernGrad
def ternary_case(n, S, seed):
    """x, residual, per-segment scales, seg, seeds (high bits set: negative int64) and starts
    for S segments of n elements, one of them tiny, lengths multiples of 4."""
    g = torch.Generator().manual_seed(seed)
    cut = torch.sort(torch.randperm(n // 4 - 1, generator=g)[: S - 2] + 1).values * 4
    bounds = torch.cat([torch.tensor([0, 4]), cut[cut > 4], torch.tensor([n])]).unique()
    lengths = bounds.diff()
    starts = bounds[:-1].clone()
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int32), lengths)
    x = values(n, seed)
    r = values(n, seed + 1) * 0.1
    scale = torch.segment_reduce((x + r).abs(), "max", lengths=lengths)
    seeds = torch.randint(-2**63, 2**63 - 1, (lengths.numel(),), generator=g, dtype=torch.int64)
    return x, r, scale, seg, seeds, starts


@pytest.mark.parametrize("with_residual", [True, False])
def test_ternary_compress_is_bit_identical_to_the_reference(with_residual):
    for i, (n, S) in enumerate([(SIZES[0], 2), (SIZES[2], 7), (SIZES[3], 60)]):
        x, r, scale, seg, seeds, starts = ternary_case(n, S, i)
        got_r, want_r = (r.clone(), r.clone()) if with_residual else (None, None)
        got = compiled.ternary_compress(x, got_r, scale, seg, seeds, starts)
        want = ref.ternary_compress(x, want_r, scale, seg, seeds, starts)
        assert torch.equal(got, want)
        assert (got != 0).any() and (ref.unpack_2bit(got) == 2).any()  # codes of both signs
        if with_residual:
            assert torch.equal(got_r, want_r)


@pytest.mark.parametrize("W", [1, 2, 3, 5])
def test_ternary_decompress_is_bit_identical_to_the_reference(W):
    n, S = SIZES[1] + 4, 9
    x, r, scale, seg, seeds, starts = ternary_case(n, S, W)
    packed = torch.stack([ref.ternary_compress(x * (w + 1), None, scale * (w + 1), seg,
                                               seeds + w, starts) for w in range(W)])
    got_msg = torch.cat([packed, torch.full((W, 12), 0xAB, dtype=torch.uint8)], 1)  # a tail
    scales = torch.stack([scale * (w + 1) for w in range(W)]) * 0.37
    scales[:, 3] = 0.0  # -1 * 0 = -0.0 terms: the + 0.0 of a zero out's add must stay
    scales[0, 5] = -0.0
    for alpha in (1.0, 1.0 / W, 0.3):
        base = values(n, 7)
        got = compiled.ternary_decompress(got_msg, scales, seg, base.clone(), alpha)
        want = ref.ternary_decompress(got_msg, scales, seg, base.clone(), alpha)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        # overwriting (the exchange's fresh buffer): that of a zero out, garbage not read
        got = compiled.ternary_decompress(got_msg, scales, seg, torch.full_like(base, float("nan")),
                                          alpha, accumulate=False)
        want = ref.ternary_decompress(got_msg, scales, seg, torch.zeros_like(base), alpha)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_ternary_counters_past_2_32():
    """The Philox counter's high word: a segment that starts far into a huge virtual layer
    (the counter is element index minus the segment start, so a negative start reaches it)."""
    x, r, scale, seg, seeds, starts = ternary_case(SIZES[0], 3, 9)
    starts = starts - (3 << 32)
    got = compiled.ternary_compress(x, None, scale, seg, seeds, starts)
    assert torch.equal(got, ref.ternary_compress(x, None, scale, seg, seeds, starts))


def test_ternary_segments_off_the_4_element_grid_run_the_reference():
    """The fused loop draws one Philox per group of four elements, which needs every segment
    to start at a multiple of 4 (TernGrad's padded layout); a segment that does not is
    still bit-identical (the reference runs it): a wrong grouping would change its codes."""
    x, r, scale, seg, seeds, starts = ternary_case(SIZES[2], 5, 3)
    starts = starts.clone()
    starts[2] += 1  # segment 2's stream counted from one element further on
    for res in (None, r):
        got_r, want_r = (None, None) if res is None else (res.clone(), res.clone())
        got = compiled.ternary_compress(x, got_r, scale, seg, seeds, starts)
        assert torch.equal(got, ref.ternary_compress(x, want_r, scale, seg, seeds, starts))
        if res is not None:
            assert torch.equal(got_r, want_r)


def test_terngrad_reduce_on_the_compiled_path_equals_the_cpu_path(monkeypatch):
    """gradcomp.State.reduce with terngrad (error feedback on), world size 1: bit for bit."""
    shapes = {"a": (384, 512), "b": (1000,), "c": (64, 64, 3, 3), "d": (10,)}
    cpu_path, auto = reduce_on_both_paths(monkeypatch, "terngrad:error_feedback=true", shapes,
                                          "ternary")
    for a, b in zip(cpu_path[:-1], auto[:-1]):
        assert torch.equal(a, b)
    for n in shapes:
        assert torch.equal(auto[-1][n], cpu_path[-1][n])
