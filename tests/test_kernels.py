"""Triton kernels against the pure-torch reference (the specification).

Without a GPU these run on CPU tensors through the Triton interpreter (TRITON_INTERPRET=1, set
by conftest.py before Triton is imported). On a GPU machine the same file runs the compiled kernels
with ``TRITON_INTERPRET=0 python -m pytest tests/test_kernels.py``.

Sizes: 0 (where meaningful), the smallest legal size, one program's worth of elements +- 1,
2^k +- 1, each padded up to the function's divisibility rule, at the module's default block
and at a 64-element block (many programs at small n); plus one size of a few million.
Every output is carved out of a guard-banded buffer and every in-place tensor sits inside
one; the guards are checked after each test (out-of-bounds writes). Inputs sit between NaN
(or out-of-range index) poison, so an unmasked read shows up in the results.
"""
import math
import os

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from gradcomp.kernels import reference as ref  # noqa: E402
from gradcomp.kernels import triton as tk  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEV = "cpu" if INTERPRET else "cuda"

# bf16: the kernels do no bf16 arithmetic (they upcast right after the load, which the
# interpreter supports), so bf16 inputs go in as they are; the expected values come from the
# reference on x.float(), the reference being specified for fp32.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SMALL_BLOCK = 64
BIG = 2930 * 1024  # ~3M: a multiple of every chunk below and of 4; not of the block
GUARD = 256


# --------------------------------------------------------------------------- helpers
class Guards:
    """Tensors living inside sentinel-filled buffers; check() says the margins are intact."""

    def __init__(self):
        self.items = []

    def embed(self, t, fill):
        """A copy of t inside a larger buffer whose margins hold ``fill``."""
        n = t.numel()
        buf = torch.full((n + 2 * GUARD,), fill, dtype=t.dtype, device=t.device)
        view = buf[GUARD:GUARD + n]
        view.copy_(t.reshape(-1))
        self.items.append((buf, n, self._margins(buf, n).clone()))
        return view.view(t.shape)

    @staticmethod
    def _margins(buf, n):
        return torch.cat([buf[:GUARD], buf[GUARD + n:]]).view(torch.uint8)  # bytes: NaN == NaN

    def alloc(self, shape, dtype, device):
        fill = {torch.uint8: 0xA5, torch.int32: -123456}.get(dtype, 1234.5)
        return self.embed(torch.full(shape, fill, dtype=dtype, device=device), fill)

    def check(self):
        for buf, n, margins in self.items:
            assert torch.equal(self._margins(buf, n), margins), "a kernel wrote outside its buffer"


@pytest.fixture(autouse=True)
def guards(monkeypatch):
    g = Guards()
    monkeypatch.setattr(tk.common, "alloc", g.alloc)
    yield g
    g.check()


@pytest.fixture(params=["default", "small"])
def block(request, monkeypatch):
    if request.param == "small":
        monkeypatch.setattr(tk.common, "BLOCK", SMALL_BLOCK)
    return tk.common.BLOCK


def poisoned(g, t):
    """t between poison: NaN for floats, an index past any table for integers, 0xFF bytes."""
    if t.is_floating_point():
        return g.embed(t, float("nan"))
    return g.embed(t, 0xFF if t.dtype == torch.uint8 else 1 << 20)


def sizes(unit, multiple=1, zero=True):
    """Element counts: 0, the smallest legal size, one program's worth (unit) +- 1 and
    2^k +- 1, each rounded up to a multiple of ``multiple``."""
    raw = {1, unit - 1, unit, unit + 1, 2**5 - 1, 2**5 + 1, 2**10 - 1, 2**10 + 1}
    out = sorted({-(-v // multiple) * multiple for v in raw if v >= 1})
    return ([0] if zero else []) + out


def randn(n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype).to(DEV)


# --------------------------------------------------------------------------- Philox
@triton.jit
def _rand_kernel(out_ptr, seed, offset, n, B: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    tl.store(out_ptr + i, tl.rand(seed, offset + i), mask=i < n)


@pytest.mark.parametrize("seed", [0, 1, 7, 2**31 - 1, 2**32 + 5, 2**63 - 1, 2**64 - 1])
@pytest.mark.parametrize("offset", [0, 2**32 - 100])  # the second crosses into counter word 1
def test_philox_uniform_is_tl_rand_bit_for_bit(seed, offset):
    n = 5000
    got = torch.empty(n, device=DEV)
    _rand_kernel[(triton.cdiv(n, 1024),)](got, seed, offset, n, B=1024)
    want = ref.philox_uniform(seed, torch.arange(offset, offset + n, device=DEV))
    assert torch.equal(got, want)
    assert 0 <= want.min() and want.max() < 1


@triton.jit
def _rand_table_kernel(out_ptr, seeds_ptr, ctr_ptr, n, B: tl.constexpr):
    # out: tl.rand, then tl.rand4x's four words (n each)
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    m = i < n
    sd, ctr = tl.load(seeds_ptr + i, mask=m, other=0), tl.load(ctr_ptr + i, mask=m, other=0)
    tl.store(out_ptr + i, tl.rand(sd, ctr), mask=m)
    u = tl.rand4x(sd, ctr)
    for w in tl.static_range(4):
        tl.store(out_ptr + (w + 1) * n + i, u[w], mask=m)


def test_philox_uniform_per_element_seeds_is_tl_rand_and_its_words_tl_rand4x():
    # a seed and a counter per element, as the segmented kernel draws them; seeds past 2^63
    # travel as their two's complement. TernGrad's stream takes all four words of a Philox
    # call: the reference's word w is tl.rand4x's w-th output
    g = torch.Generator().manual_seed(5)
    n = 4000
    pool = torch.tensor([0, 3, 2**32 + 1, 2**63 - 1, -1, -(2**40)], dtype=torch.int64)
    seeds = pool[torch.randint(0, len(pool), (n,), generator=g)].to(DEV)
    ctr = torch.randint(0, 2**34, (n,), generator=g).to(DEV)
    got = torch.empty(5 * n, device=DEV)
    _rand_table_kernel[(triton.cdiv(n, 1024),)](got, seeds, ctr, n, B=1024)
    assert torch.equal(got[:n], ref.philox_uniform(seeds, ctr))
    for w in range(4):
        want = ref.philox_uniform(seeds, ctr, torch.full_like(ctr, w))
        assert torch.equal(got[(w + 1) * n : (w + 2) * n], want)
    one = ref.philox_uniform(2**64 - 1, ctr[:10])  # int seed == its two's complement tensor
    assert torch.equal(one, ref.philox_uniform(torch.full((10,), -1, device=DEV), ctr[:10]))


# --------------------------------------------------------------------------- 1-bit
def check_onebit(g, x, chunk, with_residual, seed=0):
    n = x.numel()
    res = randn(n, seed + 1) if with_residual else None
    want_res = res.clone() if with_residual else None
    y = x.float() + res if with_residual else x.float()
    want_bits, want_scales = ref.onebit_compress(x.float(), want_res, chunk)
    x = poisoned(g, x)
    got_res = g.embed(res, 1234.5) if with_residual else None
    bits, scales = tk.onebit_compress(x, got_res, chunk)
    assert bits.dtype == torch.uint8 and scales.dtype == torch.float32
    assert torch.equal(bits, want_bits)  # y = x + r is exact in both: the signs agree exactly
    # The means are sums, in different orders (the reference adds pairwise halves, the kernel
    # in its own tree): both are within a few ulps of sum|y| / count of the exact mean.
    yc = y.view(-1, chunk)
    pos = yc >= 0
    mag = yc.abs().sum(1)
    tol = 2e-6 * torch.stack([mag / pos.sum(1).clamp_min(1), mag / (~pos).sum(1).clamp_min(1)]) + 1e-7
    assert ((scales - want_scales).abs() <= tol).all()
    if with_residual:  # y - deq: deq carries the scale's error
        etol = torch.where(pos, tol[0].unsqueeze(1), tol[1].unsqueeze(1)).view(-1)
        assert ((got_res - want_res).abs() <= etol + 1e-6 * want_res.abs()).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [8, 24, 1024])
def test_onebit_compress_matches_reference(guards, block, chunk, dtype):
    rows = max(1, block // (8 * triton.next_power_of_2(chunk // 8)))  # chunks per program
    for i, n in enumerate(sizes(rows * chunk, chunk)):
        check_onebit(guards, randn(n, i, dtype), chunk, with_residual=True, seed=i)
    check_onebit(guards, randn(33 * chunk, 5, dtype), chunk, with_residual=False)


@pytest.mark.parametrize("chunk", [72, 128, 520])
def test_onebit_compress_chunks_longer_than_a_block(guards, monkeypatch, chunk):
    monkeypatch.setattr(tk.common, "BLOCK", SMALL_BLOCK)  # chunk > block: the two-sweep kernel
    for m in (1, 3):
        check_onebit(guards, randn(m * chunk, m), chunk, with_residual=True)
        check_onebit(guards, randn(m * chunk, m, torch.bfloat16), chunk, with_residual=False)


def test_onebit_compress_large(guards):
    check_onebit(guards, randn(BIG, 0), 1024, with_residual=True)


def test_onebit_compress_special_values(guards):
    # zeros and -0.0 count as non-negative; an all-negative chunk has no positive mean (0)
    x = torch.tensor([0.0, -0.0, 1, 2, -1, -3, 0, 4] + [-1.0] * 8 + [5.0] * 8, device=DEV)
    check_onebit(guards, x, 8, with_residual=False)
    bits, scales = tk.onebit_compress(x, None, 8)
    assert bits.tolist() == [0b11001111, 0, 255]
    torch.testing.assert_close(scales.cpu(), torch.tensor([[7 / 6, 0.0, 5.0], [-2.0, -1.0, 0.0]]))


@pytest.mark.parametrize("W, alpha", [(1, 1.0), (3, 0.5)])
@pytest.mark.parametrize("chunk", [8, 24, 1024])
def test_onebit_decompress_matches_reference(guards, block, chunk, W, alpha):
    g = torch.Generator().manual_seed(chunk)
    for n in sizes(block, chunk):  # block: elements per program
        bits = torch.randint(0, 256, (W, n // 8), generator=g, dtype=torch.uint8).to(DEV)
        scales = torch.randn(W, 2, n // chunk, generator=g).to(DEV)
        out = randn(n, n)
        want = ref.onebit_decompress(bits, scales, chunk, out.clone(), alpha)
        got = guards.embed(out, 1234.5)
        tk.onebit_decompress(poisoned(guards, bits), poisoned(guards, scales), chunk, got, alpha)
        if W == 1 and alpha == 1.0:
            assert torch.equal(got, want)
        else:  # a GPU may fuse out + alpha * sum into one rounding
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_onebit_round_trip_conserves_mass(guards):
    # error feedback: dequantized message + new residual == x + old residual
    n, chunk = 40 * 1024, 1024
    x, r = randn(n, 1), randn(n, 2)
    y = x.double() + r.double()
    bits, scales = tk.onebit_compress(x, r, chunk)
    out = torch.zeros(n, device=DEV)
    tk.onebit_decompress(bits.unsqueeze(0), scales.unsqueeze(0), chunk, out)
    torch.testing.assert_close(out.double() + r.double(), y, rtol=0, atol=1e-5)


def test_onebit_large_decompress(guards):
    W, chunk = 2, 1024
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 256, (W, BIG // 8), generator=g, dtype=torch.uint8).to(DEV)
    scales = torch.randn(W, 2, BIG // chunk, generator=g).to(DEV)
    out = randn(BIG, 3)
    want = ref.onebit_decompress(bits, scales, chunk, out.clone(), 0.5)
    torch.testing.assert_close(tk.onebit_decompress(bits, scales, chunk, out, 0.5), want,
                               rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- TernGrad
def ternary_case(n, seed, dtype=torch.float32, nseg=3):
    x = randn(n, seed, dtype)
    res = randn(n, seed + 1) * 0.1
    g = torch.Generator().manual_seed(seed)
    seg = torch.sort(torch.randint(0, nseg, (n,), generator=g)).values.to(DEV)
    y = x.float() + res
    scale = torch.zeros(nseg, device=DEV).scatter_reduce_(0, seg, y.abs(), "amax")
    return x, res, scale, seg


def check_ternary(g, n, seed, dtype=torch.float32, with_residual=True, seg_dtype=torch.int64,
                  per_seg=False):
    """The kernel against the reference ternary_compress, bit for bit (codes and residual).
    per_seg: a seed per segment, each segment's stream counted from its first element."""
    x, res, scale, seg = ternary_case(n, seed, dtype)
    seg = seg.to(seg_dtype)
    if not with_residual:
        res = None
    starts = None
    if per_seg:
        nseg = scale.numel()
        starts = torch.searchsorted(seg.long(), torch.arange(nseg, device=DEV))
        seed = torch.tensor([seed * 7919 + k for k in range(nseg)], dtype=torch.int64, device=DEV)
    want_res = res.clone() if with_residual else None
    want_packed = ref.ternary_compress(x.float(), want_res, scale, seg, seed, starts)
    got_res = g.embed(res, 1234.5) if with_residual else None
    packed = tk.ternary_compress(
        poisoned(g, x), got_res, g.embed(scale, float("nan")), poisoned(g, seg),
        poisoned(g, seed) if per_seg else seed, poisoned(g, starts) if per_seg else None)
    assert torch.equal(packed, want_packed)
    if with_residual:
        assert torch.equal(got_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ternary_compress_matches_reference(guards, block, dtype):
    for i, n in enumerate(sizes(block, 4)):
        check_ternary(guards, n, 100 + i, dtype)
    check_ternary(guards, 4 * 33, 7, dtype, with_residual=False, seg_dtype=torch.int32)


def test_ternary_compress_per_segment_seeds_matches_reference(guards, block):
    for i, n in enumerate(sizes(block, 4, zero=False)):
        check_ternary(guards, n, 300 + i, per_seg=True)
    check_ternary(guards, 4 * 257, 9, with_residual=False, seg_dtype=torch.int32, per_seg=True)


def test_ternary_segment_stream_does_not_depend_on_its_place(guards):
    # a segment's codes are those of the same values compressed alone with its seed
    g = torch.Generator().manual_seed(0)
    lens = [12, 4, 400, 8]
    x = torch.randn(sum(lens), generator=g).to(DEV)
    seg = torch.repeat_interleave(torch.arange(4), torch.tensor(lens)).to(DEV)
    scale = torch.zeros(4, device=DEV).scatter_reduce_(0, seg, x.abs(), "amax")
    seeds = torch.tensor([11, 2**62 + 3, 5, 7], dtype=torch.int64, device=DEV)
    starts = torch.tensor([0, 12, 16, 416], dtype=torch.int64, device=DEV)
    codes = ref.unpack_2bit(tk.ternary_compress(x, None, scale, seg, seeds, starts))
    for k, (a, m) in enumerate(zip(starts.tolist(), lens)):
        alone = tk.ternary_compress(x[a:a + m].contiguous(), None, scale[k:k + 1],
                                    torch.zeros(m, dtype=torch.long, device=DEV), int(seeds[k]))
        assert torch.equal(codes[a:a + m], ref.unpack_2bit(alone))


def test_ternary_compress_large(guards):
    check_ternary(guards, BIG, 2**40 + 3)


def test_ternary_compress_edge_cases(guards):
    # |y| == s always kept, y == 0 never (u < 1), the residual exact
    x = torch.tensor([0.5, -0.5, 1.0, 0.0, -1.0, 0.0, 0.25, -0.0], device=DEV)
    res = torch.zeros(8, device=DEV)
    packed = tk.ternary_compress(x, res, torch.tensor([1.0], device=DEV),
                                 torch.zeros(8, dtype=torch.long, device=DEV), 3)
    codes = ref.unpack_2bit(packed)
    assert codes[2] == 1 and codes[4] == 2 and codes[3] == 0 and codes[5] == 0 and codes[7] == 0
    q = (codes == 1).float() - (codes == 2).float()
    assert torch.equal(res, x - q)


def test_ternary_is_reproducible_per_seed(guards):
    x, res, scale, seg = ternary_case(3000, 0)
    runs = {}
    for seed in (7, 7, 8):
        r = res.clone()
        runs.setdefault(seed, []).append((tk.ternary_compress(x, r, scale, seg, seed), r))
    (a, ra), (b, rb) = runs[7]
    assert torch.equal(a, b) and torch.equal(ra, rb)
    assert not torch.equal(a, runs[8][0][0])


def test_ternary_kernel_is_unbiased(guards):
    # 256 values, each repeated over R replicas (distinct Philox counters) and several seeds
    base = randn(256, 0)
    seg1 = (torch.arange(256, device=DEV) >= 128).long()
    scale = torch.stack([base[:128].abs().max(), base[128:].abs().max()])
    R, seeds = 1024, 4
    x = base.repeat(R)
    seg = seg1.repeat(R)
    acc = torch.zeros(x.numel(), device=DEV)
    for s in range(seeds):
        packed = tk.ternary_compress(x, None, scale, seg, seed=1000 + s)
        tk.ternary_decompress(packed.unsqueeze(0), scale.unsqueeze(0), seg, acc)
    draws = R * seeds
    mean = acc.view(R, 256).sum(0) / draws
    # per-element std of one draw <= scale; of the mean <= scale / sqrt(draws): allow 5 sigma
    tol = 5 * scale[seg1] / math.sqrt(draws)
    assert ((mean - base).abs() <= tol).all()
    assert not ((torch.sign(base) * scale[seg1] - base).abs() <= tol).all()  # bias is caught


@pytest.mark.parametrize("W, alpha", [(1, 1.0), (3, 0.25)])
def test_ternary_decompress_matches_reference(guards, block, W, alpha):
    g = torch.Generator().manual_seed(W)
    S = 5
    for n in sizes(block):  # out need not be a multiple of 4 here
        row = -(-n // 4) + 2  # rows may be longer than n/4 bytes (padding)
        packed = torch.randint(0, 256, (W, row), generator=g, dtype=torch.uint8).to(DEV)
        scale = torch.rand(W, S, generator=g).to(DEV)
        seg = torch.randint(0, S, (n,), generator=g).to(DEV)
        out = randn(n, n)
        want = ref.ternary_decompress(packed, scale, seg, out.clone(), alpha)
        got = guards.embed(out, 1234.5)
        tk.ternary_decompress(poisoned(guards, packed), poisoned(guards, scale),
                              poisoned(guards, seg), got, alpha)
        if W == 1 and alpha == 1.0:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def ternary_bucket(sizes_, seed, gap=3):
    """Segments of ``sizes_`` elements laid in x ``gap`` apart (the padded layout: each
    rounded up to a multiple of 4, end to end): x, xoff, numel, lengths, starts, seg."""
    lens = [-(-m // 4) * 4 for m in sizes_]
    xoff = [gap * (k + 1) + sum(sizes_[:k]) for k in range(len(sizes_))]
    x = randn(gap * (len(sizes_) + 1) + sum(sizes_), seed)
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=DEV)  # noqa: E731
    seg = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32),
                                  torch.tensor(lens, dtype=torch.int64)).to(DEV)
    return x, t(xoff), t(sizes_), t(lens), t([sum(lens[:k]) for k in range(len(lens))]), seg


TERN_SIZES = [[1], [5, 130, 64, 3, 257], [2049, 7, 4096 + 3]]


@pytest.mark.parametrize("clip", [0.0, 2.5])
@pytest.mark.parametrize("chunk", [None, 128])  # 128: segments over many chunks
def test_ternary_stats_matches_reference(guards, block, clip, chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(ref, "STATS_CHUNK", chunk)
    for i, sz in enumerate(TERN_SIZES + [[0, 64, 0, 9]]):
        x, xoff, numel, lens, _, _ = ternary_bucket(sz, 40 + i)
        want_s, want_b = ref.ternary_stats(x, xoff, numel, lens, clip)
        chunks = ref.stats_chunks(sz, DEV) if i % 2 else None  # given, or made by the call
        got_s, got_b = tk.ternary_stats(poisoned(guards, x), poisoned(guards, xoff),
                                        poisoned(guards, numel), poisoned(guards, lens), clip,
                                        chunks)
        if 0 in sz:  # an empty segment: 0 / 0 is NaN (as the element path's mean)
            keep = numel > 0
            assert got_s[~keep].isnan().all() == bool(clip)
            got_s, got_b, want_s, want_b, sz = (got_s[keep], got_b[keep], want_s[keep],
                                                want_b[keep], [m for m in sz if m])
            xoff = xoff[keep]
        if not clip:
            assert torch.equal(got_s, want_s)  # max |y|: exact
            continue
        torch.testing.assert_close(got_b, want_b, rtol=1e-5, atol=0)
        top = torch.stack([x[a:a + m].abs().max() for a, m in zip(xoff.tolist(), sz)])
        assert torch.equal(got_s, torch.minimum(top, got_b))


@pytest.mark.parametrize("clip", [False, True])
def test_ternary_encode_matches_reference(guards, block, clip):
    for i, sz in enumerate(TERN_SIZES + [[0, 4, 0, 9]]):
        x, xoff, numel, lens, starts, seg = ternary_bucket(sz, 60 + i)
        scale = torch.rand(len(sz), device=DEV) * 3
        bound = torch.rand(len(sz), device=DEV) * 2 if clip else None
        seeds = torch.tensor([2**40 + 977 * k for k in range(len(sz))], device=DEV)
        nbytes = (seg.numel() + 4) // 5
        D = [0, 1, 70, 200][i % 4]  # dense values gathered from x by the same launch
        pos = torch.randint(0, x.numel(), (D,), generator=torch.Generator().manual_seed(i))
        pos = pos.to(DEV)
        want_d = torch.empty(D, device=DEV)
        want = ref.ternary_encode(x, xoff, numel, scale, bound, seg, seeds, starts,
                                  torch.empty(nbytes, dtype=torch.uint8, device=DEV), x, pos,
                                  want_d)
        got = guards.alloc((nbytes,), torch.uint8, DEV)
        got_d = guards.alloc((D,), torch.float32, DEV)
        xp = poisoned(guards, x)
        tk.ternary_encode(xp, poisoned(guards, xoff), poisoned(guards, numel),
                          poisoned(guards, scale), poisoned(guards, bound) if clip else None,
                          poisoned(guards, seg), poisoned(guards, seeds), poisoned(guards, starts),
                          got, xp, poisoned(guards, pos), got_d)
        assert torch.equal(got, want)
        assert torch.equal(got_d, want_d)
        assert int(want.max()) < 243


def test_ternary_encode_is_ternary_compress_in_base_3(guards):
    x, xoff, numel, lens, starts, seg = ternary_bucket([12, 400, 8], 5, gap=0)
    scale = torch.rand(3, device=DEV) * 3
    seeds = torch.tensor([1, 2, 3], device=DEV)
    got = tk.ternary_encode(x, xoff, numel, scale, None, seg, seeds, starts,
                            torch.empty(84, dtype=torch.uint8, device=DEV))
    codes = ref.unpack_2bit(tk.ternary_compress(x, None, scale, seg, seeds, starts))
    assert torch.equal(ref.unpack_base3(got, 420), codes)


@pytest.mark.parametrize("W", [1, 3])
@pytest.mark.parametrize("shared", [False, True])
def test_ternary_decode_matches_reference(guards, block, W, shared):
    g = torch.Generator().manual_seed(W)
    comp, dense = [5, 130, 64, 3, 257, 2049], [3, 70, 1]
    entries = comp + dense
    n = sum(entries) + 2 * len(entries) + 1  # a gap of 2 before each entry, one at the end
    xoff = [2 * (k + 1) + sum(entries[:k]) for k in range(len(entries))]
    npad = sum(-(-m // 4) * 4 for m in comp)
    src = [sum(-(-m // 4) * 4 for m in comp[:k]) for k in range(len(comp))]
    src += [sum(dense[:k]) for k in range(len(dense))]
    xseg = torch.full((n,), -1, dtype=torch.int32)
    for k, (a, m) in enumerate(zip(xoff, entries)):
        xseg[a:a + m] = k
    row = (npad + 4) // 5 + 3  # rows a message apart: codes, then other fields
    msgs = torch.randint(0, 243, (W, row + 4 * len(comp) + 4 * sum(dense)), generator=g,
                         dtype=torch.uint8).to(DEV)
    codes = msgs[:, :(npad + 4) // 5]
    vals = torch.randn(W, len(comp) + sum(dense), generator=g).to(DEV)
    scales = vals[:1, :len(comp)].expand(W, -1) if shared else vals[:, :len(comp)]
    dv = vals[:, len(comp):]
    xseg, t = xseg.to(DEV), (lambda v: torch.tensor(v, dtype=torch.int64, device=DEV))
    want = ref.ternary_decode(codes, scales, dv, xseg, t(xoff), t(src), len(comp),
                              torch.empty(n, device=DEV), 1.0 / W)
    got = guards.alloc((n,), torch.float32, DEV)
    tk.ternary_decode(codes, scales, dv, poisoned(guards, xseg), poisoned(guards, t(xoff)),
                      poisoned(guards, t(src)), len(comp), got, 1.0 / W)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    if W == 1:  # one message: the dense values as they are, the codes as ternary_decompress's
        at = [a for a, m in zip(xoff[len(comp):], dense)]
        assert torch.equal(got[at[1]:at[1] + 70], dv[0, 3:73])
    # the guard's verdict in the same launch: flag down, the same bits; up, NaN throughout;
    # the other flag zeroed either way
    for mod in (ref, tk):
        for up in (0.0, 1.0):
            flag = torch.tensor([up, 6.0, -6.0], device=DEV)
            clear = torch.tensor([1.0, 2.0, -2.0], device=DEV)
            v = mod.ternary_decode(codes, scales, dv, xseg, t(xoff), t(src), len(comp),
                                   torch.empty(n, device=DEV), 1.0 / W, (flag, clear))
            assert clear.tolist() == [0.0, 2.0, -2.0] and flag.tolist() == [up, 6.0, -6.0]
            assert v.isnan().all() if up else torch.equal(v.view(torch.int32),
                                                         want.view(torch.int32))


# --------------------------------------------------------------------------- top-k select
def check_select(g, x, threshold, k, capacity):
    want_v, want_i = ref.select_topk(x.float(), threshold, k, capacity)
    got_v, got_i = tk.select_topk(poisoned(g, x), threshold, k, capacity)
    assert got_v.dtype == torch.float32 and got_i.dtype == torch.int32
    ow, og = torch.argsort(want_i.long() * 2 + (want_v == 0)), torch.argsort(got_i.long() * 2 + (got_v == 0))
    assert torch.equal(got_i[og], want_i[ow])
    assert torch.equal(got_v[og], want_v[ow])


def sampled_threshold(x, k):
    g = torch.Generator().manual_seed(x.numel())
    sample = torch.randint(0, x.numel(), (max(1, x.numel() // 10),), generator=g).to(DEV)
    return ref.sample_threshold(x.float(), math.ceil(1.5 * k), sample)


@pytest.mark.parametrize("dtype", DTYPES)
def test_select_topk_matches_reference(guards, block, dtype):
    for n in sizes(block, zero=False):
        x = randn(n, n, dtype)
        k = max(1, n // 20)
        check_select(guards, x, sampled_threshold(x, k), k, min(n, 2 * k))


def test_select_topk_large(guards):
    x = randn(BIG, 1)
    k = BIG // 1000
    check_select(guards, x, sampled_threshold(x, k), k, 2 * k)


def test_select_topk_overflow_and_underflow(guards, monkeypatch):
    monkeypatch.setattr(tk.common, "BLOCK", SMALL_BLOCK)
    x = randn(1000, 3)
    zero = torch.tensor(0.0, device=DEV)
    check_select(guards, x, zero, 10, 20)                                 # all pass: first 20 kept
    check_select(guards, x, torch.tensor(10.0, device=DEV), 10, 20)       # none pass: zeros
    check_select(guards, x, torch.tensor(2.0, device=DEV), 10, 10)        # a few pass
    x[::3] = 0.0
    check_select(guards, x, zero, 30, 500)                                # zeros pass: index 0
    check_select(guards, torch.zeros(0, device=DEV), zero, 3, 4)          # n = 0


@pytest.mark.parametrize("block", [SMALL_BLOCK, None])
def test_segmented_radix_select_matches_the_sorts(block, monkeypatch):
    """DGC's segmented select with its magnitudes ranked by the Triton radix select
    (segment_sample, segment_kth, segment_take) equals the sorts' ranking bit for bit, values,
    indices and thresholds: one large parameter and many small ones with gaps, ties."""
    from gradcomp.kernels import segmented as S
    if block:
        monkeypatch.setattr(tk.common, "BLOCK", block)
    g = torch.Generator().manual_seed(5)
    big = 400_000 if block is None else 20_000
    layouts = [((0, big),), tuple((i * 1030 + 7, 1000 + i) for i in range(12)),
               ((0, 3), (3, big // 4), (big // 4 + 9, 1), (big // 4 + 10, 5000))]
    for trial, layout in enumerate(layouts):
        n = layout[-1][0] + layout[-1][1] + 4
        x = torch.randn(n, generator=g)
        if trial == 2:
            x = torch.round(x * 3)  # ties at every threshold
        x = x.to(DEV)
        for ratio, sr in ((0.001, 0.01), (0.05, 0.5)):
            pl = S.topk_plan(layout, n, ratio, sr, torch.device(DEV))
            shifts = torch.tensor([S.shift(7 + p, m) for p, (_, m) in enumerate(layout)],
                                  device=DEV)
            want = S.select(x, pl, shifts, "cumsum", "sort")
            got = S.select(x, pl, shifts, "triton", "triton")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (trial, ratio)
            assert torch.equal(got[2].nan_to_num(-1), want[2].nan_to_num(-1)), (trial, ratio)


# --------------------------------------------------------------------------- scatter-add
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_scatter_add_matches_reference(guards, block, idx_dtype):
    g = torch.Generator().manual_seed(0)
    for m in sizes(block):
        n = 2 * m + 3
        unique = torch.randperm(n, generator=g)[:m].to(idx_dtype).to(DEV)
        vals = torch.randn(m, generator=g).to(DEV)
        out = randn(n, m)
        want = ref.scatter_add(vals, unique, out.clone())
        got = guards.embed(out, 1234.5)
        tk.scatter_add(poisoned(guards, vals), poisoned(guards, unique), got)
        assert torch.equal(got, want)  # no duplicates: each element gets one exact add
        dup = torch.randint(0, max(1, m // 4), (2, m), generator=g).to(idx_dtype).to(DEV)
        vals2 = torch.randn(2, m, generator=g).to(DEV)
        want = ref.scatter_add(vals2, dup, out.clone(), alpha=0.5)
        torch.testing.assert_close(tk.scatter_add(vals2, dup, out.clone(), alpha=0.5), want,
                                   rtol=1e-5, atol=1e-5)  # duplicates: atomics in any order


def test_scatter_add_drops_out_of_range_indices(guards):
    out = guards.embed(torch.zeros(10, device=DEV), 1234.5)
    idx = torch.tensor([-1, 3, 10, 1 << 20], dtype=torch.int32, device=DEV)
    tk.scatter_add(torch.ones(4, device=DEV), idx, out)
    assert out.tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]


# --------------------------------------------------------------------------- native build
_COMPILE_ALL = r"""
import sys
import triton
import triton.backends
from triton.backends.compiler import GPUTarget
if "nvidia" not in triton.backends.backends:
    sys.exit(3)
from gradcomp.kernels import triton as tk
P, C = "*fp32", "constexpr"
specs = [
    (tk.onebit._onebit_compress_rows, ["*bf16", P, "*u8", P, "i32", "i32"], dict(HAS_RES=True, ROWS=4, BYTES=128)),
    (tk.onebit._onebit_compress_rows, [P, P, "*u8", P, "i32", "i32"], dict(HAS_RES=False, ROWS=512, BYTES=1)),
    (tk.onebit._onebit_compress_long, ["*fp16", P, "*u8", P, "i32", "i32"], dict(HAS_RES=True, BYTES=512)),
    (tk.onebit._onebit_decompress_kernel, ["*u8", P, P, "i32", "i32", "i32", "i32", "fp32"], dict(BYTES=512)),
    (tk.terngrad._ternary_compress_kernel, [P, P, P, "*i64", "*i64", "*i64", "*u8", "i64", "i32"],
     dict(HAS_RES=True, PER_SEG=False, BYTES=1024)),
    (tk.terngrad._ternary_compress_kernel, ["*bf16", P, P, "*i32", "*i64", "*i64", "*u8", "u64", "i32"],
     dict(HAS_RES=False, PER_SEG=True, BYTES=1024)),
    (tk.terngrad._ternary_decompress_kernel, ["*u8", P, "*i64", P, "i32", "i32", "i32", "i32", "fp32"], dict(BYTES=1024)),
    (tk.terngrad._ternary_partials_kernel, [P, "*i64", "*i64", "*i32", "*i64", P, "i32"],
     dict(CHUNK=65536, BLOCK=2048)),
    (tk.terngrad._ternary_partials_kernel, ["*bf16", "*i64", "*i64", "*i32", "*i64", P, "i32"],
     dict(CHUNK=65536, BLOCK=2048)),
    (tk.terngrad._ternary_stats_kernel, [P, "*i64", "*i64", P, P, "fp32", "i32"], dict(CLIP=True, BLOCK=2048)),
    (tk.terngrad._ternary_stats_kernel, [P, "*i64", "*i64", P, P, "fp32", "i32"], dict(CLIP=False, BLOCK=2048)),
    (tk.terngrad._ternary_encode_kernel, [P, "*i64", "*i64", P, P, "*i32", "*i64", "*i64", "*u8", P,
                                          "*i64", P, "i64", "i32", "i32", "i32"],
     dict(CLAMP=True, BYTES=256, DENSE=2048)),
    (tk.terngrad._ternary_encode_kernel, ["*bf16", "*i64", "*i64", P, P, "*i32", "*i64", "*i64", "*u8",
                                          P, "*i64", P, "i32", "i32", "i32", "i32"],
     dict(CLAMP=False, BYTES=256, DENSE=2048)),
    (tk.terngrad._ternary_decode_kernel, ["*u8", P, P, "*i32", "*i64", "*i64", P, P, P, "i32", "i32",
                                          "i32", "i32", "i32", "i32", "fp32", "fp32"],
     dict(HAS_FLAG=True, BLOCK=2048)),
    (tk.topk._count_kernel, [P, P, "*i32", "i32"], dict(BLOCK_=4096)),
    (tk.topk._compact_kernel, ["*fp16", P, "*i64", P, "*i32", "i32", "i32"], dict(BLOCK_=4096)),
    (tk.topk._scatter_add_kernel, [P, "*i64", P, "i32", "i32", "fp32"], dict(BLOCK_=4096)),
    (tk.powersgd._psgd_project_kernel, [P, P, P, P, "*i64", "*i64", "*i64", "i32", "i32", "i32"],
     dict(BN=32, BK=64, R=4, HAS_E=True, BLOCK=2048)),
    (tk.powersgd._psgd_project_kernel, ["*bf16", "*bf16", P, P, "*i64", "*i64", "*i64", "i32", "i32",
                                        "i32"], dict(BN=32, BK=64, R=2, HAS_E=False, BLOCK=2048)),
    (tk.powersgd._psgd_back_kernel, ["*bf16", P, P, P, "*i64", "*i64"], dict(BN=32, BK=64, R=1, HAS_E=False)),
    (tk.powersgd._psgd_back_kernel, [P, P, P, P, "*i64", "*i64"], dict(BN=32, BK=64, R=4, HAS_E=True)),
    (tk.powersgd._psgd_expand_kernel, [P, P, "*fp16", "*fp16", "*fp16", "*i64", "*i64", "*i64", P, P,
                                       "i32", "i32", "i32", "i32", "fp32", "fp32"],
     dict(BN=32, BK=64, R=8, HAS_E=False, HAS_FLAG=True, BLOCK=2048)),
    (tk.powersgd._psgd_expand_kernel, [P, P, P, P, P, "*i64", "*i64", "*i64", P, P, "i32", "i32", "i32",
                                       "i32", "fp32", "fp32"],
     dict(BN=32, BK=64, R=4, HAS_E=True, HAS_FLAG=False, BLOCK=2048)),
    (tk.powersgd._psgd_expand_kernel, ["*bf16", P, "*bf16", "*bf16", P, "*i64", "*i64", "*i64", P, P,
                                       "i32", "i32", "i32", "i32", "fp32", "fp32"],
     dict(BN=32, BK=64, R=2, HAS_E=True, HAS_FLAG=True, BLOCK=2048)),
    (tk.powersgd._psgd_orthonormalize_kernel, [P, "*i64"], dict(FALLBACK=1e-12, BN=128, R=4, PASSES=3)),
    (tk.topk._seg_count_kernel, [P, P, "*i32", "*i64", "*i64", "*fp16", "*i64", "*i32", "i32", "i32",
                                 "i32"], dict(BLOCK_=2048)),
    (tk.topk._excl_scan_kernel, ["*i64", "i32"], dict(BLOCK_=2048)),
    (tk.topk._seg_compact_kernel, ["*fp16", P, "*i32", "*i64", "*i64", "*i64", "*i64", "*i64", "*fp16",
                                   "*i64", "i32"], dict(BLOCK_=2048)),
    (tk.sparse._sparse_encode_kernel, ["*i16", P, "*i64", P, P, "*i64", "*i32", "*i16", P, "*u8", "i32",
                                       "i32", "i32"], dict(HAS_RES=True, BLOCK_=2048)),
    (tk.sparse._sparse_decode_kernel, ["*i32", "*i16", "*i64", P] + ["i32"] * 7,
     dict(KIND=2, BLOCK_=2048)),
    (tk.sparse._sparse_decode_kernel, ["*i32", "*i32", "*i64", P] + ["i32"] * 7,
     dict(KIND=0, BLOCK_=2048)),
    (tk.threshold._threshold_sample_kernel, [P, P, P] + ["*i64"] * 6 + [P, "*i64", P, "i32", "i32",
                                                                        "i32"],
     dict(HAS_E=True, BLOCK_=2048)),
    (tk.threshold._threshold_tau_kernel, ["*i64", "*i64", P] + ["*i64"] * 3 + [P] + ["*i64"] * 4
     + [P, P, "i32", "i32", "i32", "i32", "fp32", "fp32"], dict(ADAPTIVE=True, BLOCK_=1024)),
    (tk.threshold._threshold_tau_kernel, ["*i64", "*i64", P] + ["*i64"] * 3 + [P] + ["*i64"] * 4
     + [P, P, "i32", "i32", "i32", "i32", "fp32", "fp32"], dict(ADAPTIVE=False, BLOCK_=1024)),
    (tk.threshold._threshold_encode_kernel, [P, "*i64", "*i64", P, P, P, "*i64", "*i32", "i32", "i32",
                                             "i32"], dict(HAS_RES=True, BLOCK_=2048)),
    (tk.threshold._threshold_decode_kernel, ["*i32", "*i64", "*i64", P, "i32", "i32", "i32", "i32",
                                             "i32"], dict(BLOCK_=2048)),
]
for fn, types, cx in specs:
    names = fn.arg_names
    sig = dict(zip(names, types + [C] * (len(names) - len(types))))
    triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=cx),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=tk.common.NUM_WARPS))
print("compiled", len(specs))
"""


@pytest.mark.skipif(not INTERPRET, reason="natively the kernels are compiled by the tests above")
def test_kernels_compile_for_a_gpu():
    # the interpreter accepts some programs the compiler rejects: build every kernel down to
    # an sm_90 cubin (no GPU needed) so that such a kernel fails here, not first on a GPU
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, "-c", _COMPILE_ALL], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode == 3:
        pytest.skip("Triton's CUDA backend is not installed")
    assert r.returncode == 0, r.stderr[-3000:]


# --------------------------------------------------------------------------- validation
def test_non_contiguous_inputs_raise():
    x = torch.randn(64, device=DEV)[::2]
    seg = torch.zeros(32, dtype=torch.long, device=DEV)
    s = torch.ones(1, device=DEV)
    with pytest.raises(ValueError, match="contiguous"):
        tk.onebit_compress(x, None, 8)
    with pytest.raises(ValueError, match="contiguous"):
        tk.onebit_compress(x.contiguous(), torch.zeros(64, device=DEV)[::2], 8)
    with pytest.raises(ValueError, match="contiguous"):
        tk.ternary_compress(x, None, s, seg, 0)
    with pytest.raises(ValueError, match="contiguous"):
        tk.select_topk(x, torch.tensor(0.5, device=DEV), 2, 4)
    out = torch.zeros(32, device=DEV)
    bits = torch.zeros(4, 2, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="contiguous"):
        tk.onebit_decompress(bits.t(), torch.zeros(2, 2, 4, device=DEV), 8, out)
    with pytest.raises(ValueError, match="contiguous"):
        tk.ternary_decompress(torch.zeros(8, 2, dtype=torch.uint8, device=DEV).t(),
                              s.view(1, 1).expand(2, 1), seg, out)
    with pytest.raises(ValueError, match="contiguous"):
        tk.scatter_add(torch.ones(4, 2, device=DEV).t(),
                       torch.zeros(2, 4, dtype=torch.int32, device=DEV), out)


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="chunk"):
        tk.onebit_compress(torch.zeros(24, device=DEV), None, 16)
    with pytest.raises(ValueError, match="chunk"):
        tk.onebit_compress(torch.zeros(24, device=DEV), None, 12)
    with pytest.raises(ValueError, match="n % 4"):
        tk.ternary_compress(torch.zeros(6, device=DEV), None, torch.ones(1, device=DEV),
                            torch.zeros(6, dtype=torch.long, device=DEV), 0)
    with pytest.raises(ValueError, match="capacity"):
        tk.select_topk(torch.zeros(6, device=DEV), torch.tensor(0.0, device=DEV), 5, 4)


# --------------------------------------------------------------------------- inf/NaN guard
def check_finite_copy(g, x):
    flag = g.embed(torch.tensor([0.0, 7.0, -7.0], device=DEV), float("nan"))
    want_flag = torch.tensor([0.0, 7.0, -7.0], device=DEV)
    want = ref.finite_copy(x.clone(), want_flag)
    got = tk.finite_copy(poisoned(g, x), flag)
    assert got.dtype == x.dtype
    # bit for bit: -0.0 stays -0.0, every finite value keeps its bits
    assert torch.equal(got.view(torch.uint8 if x.element_size() == 1 else torch.int16
                                if x.element_size() == 2 else torch.int32),
                       want.view(torch.uint8 if x.element_size() == 1 else torch.int16
                                 if x.element_size() == 2 else torch.int32))
    assert torch.equal(flag, want_flag)  # only flag[0], and only where x held one
    return flag


# the interpreter has no bf16 arithmetic (the kernel compares in fp32 after the load; bf16 on
# a GPU)
FINITE_DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])


@pytest.mark.parametrize("dtype", FINITE_DTYPES)
def test_finite_copy_matches_reference(guards, block, dtype):
    for n in sizes(block):
        x = randn(n, n, dtype)
        assert check_finite_copy(guards, x)[0] == 0
        if n:
            for pos, v in ((n - 1, float("nan")), (0, float("inf")), (n // 2, float("-inf"))):
                bad = x.clone()
                bad[n // 3] = -0.0
                bad[pos] = v
                assert check_finite_copy(guards, bad)[0] == 1


def test_finite_copy_everywhere_bad_and_a_flag_already_up(guards, monkeypatch):
    monkeypatch.setattr(tk.common, "BLOCK", SMALL_BLOCK)
    x = torch.full((3 * SMALL_BLOCK + 5,), float("nan"), device=DEV)
    x[::7] = float("inf")
    flag = torch.tensor([1.0], device=DEV)
    out = tk.finite_copy(x, flag)
    assert torch.equal(out, torch.zeros_like(x)) and flag.item() == 1.0
    # a flag already up stays up on a finite bucket (the kernel only ever raises it)
    assert tk.finite_copy(torch.ones(5, device=DEV), flag).sum() == 5 and flag.item() == 1.0


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_finite_copy_in_place_equals_the_copy(impl, monkeypatch):
    """``out=x`` (the guard's late path): x itself holds what the copy holds, bit for bit,
    across blocks, and the flag is raised alike."""
    monkeypatch.setattr(tk.common, "BLOCK", SMALL_BLOCK)
    fn = tk.finite_copy if impl == "triton" else ref.finite_copy
    x = torch.randn(3 * SMALL_BLOCK + 5, generator=torch.Generator().manual_seed(0)).to(DEV)
    x[[1, SMALL_BLOCK + 2, -1]] = torch.tensor([float("nan"), float("inf"), -float("inf")],
                                               device=DEV)
    x[4] = -0.0
    f_copy, f_in = torch.zeros(1, device=DEV), torch.zeros(1, device=DEV)
    want = fn(x, f_copy)
    got = fn(x, f_in, out=x)
    assert got is x and torch.equal(x.view(torch.int32), want.view(torch.int32))
    assert f_in.item() == f_copy.item() == 1.0
    with pytest.raises(ValueError, match="out must be x's size and dtype"):
        fn(x, f_in, out=torch.zeros(5, device=DEV))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_finite_copy_writes_the_step_and_flag_fill_clears_the_next_flag(impl, monkeypatch):
    """The guard's flags made on the device: finite_copy with ``step`` writes (.., s, -s)
    over whatever flag[1:3] held (an empty x too) and only ever raises flag[0]; flag_fill
    with ``clear`` zeroes clear[0] alone, whether or not it fills, and refuses the flag
    itself as ``clear``."""
    monkeypatch.setattr(tk.common, "BLOCK", SMALL_BLOCK)
    copy, fill = (tk.finite_copy, tk.flag_fill) if impl == "triton" else (ref.finite_copy,
                                                                          ref.flag_fill)
    x = torch.randn(3 * SMALL_BLOCK + 5, generator=torch.Generator().manual_seed(1)).to(DEV)
    for xs, want0 in ((x, 0.0), (x[:0], 0.0), (torch.where(x > 1, float("nan"), x), 1.0)):
        flag = torch.tensor([0.0, 123.0, float("nan")], device=DEV)
        copy(xs, flag, step=2.0**24 - 1)
        assert flag.tolist() == [want0, 2.0**24 - 1, -(2.0**24 - 1)]
    for up in (0.0, 1.0):
        for n in (0, 5, 3 * SMALL_BLOCK + 1):
            out = torch.ones(n, device=DEV)
            flag = torch.tensor([up, 4.0, -4.0], device=DEV)
            clear = torch.tensor([1.0, 9.0, -9.0], device=DEV)
            fill(out, flag, clear=clear)
            assert clear.tolist() == [0.0, 9.0, -9.0]
            assert flag.tolist() == [up, 4.0, -4.0]
            assert bool(out.isnan().all()) == bool(up) or n == 0
    with pytest.raises(ValueError, match="clear must be another tensor than flag"):
        fill(torch.ones(3, device=DEV), flag, clear=flag)
    with pytest.raises(ValueError, match="flag must be fp32 with at least 3 elements"):
        copy(x, torch.zeros(1, device=DEV), step=3.0)


def test_finite_copy_rejects_bad_input():
    with pytest.raises(ValueError, match="flat contiguous"):
        tk.finite_copy(torch.zeros(4, 4, device=DEV), torch.zeros(1, device=DEV))
    with pytest.raises(ValueError, match="flag must be fp32"):
        tk.finite_copy(torch.zeros(4, device=DEV), torch.zeros(1, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="flag must be fp32"):
        ref.finite_copy(torch.zeros(4), torch.zeros(0))


@pytest.mark.parametrize("dtype", FINITE_DTYPES)
@pytest.mark.parametrize("up", [0.0, 1.0])
def test_flag_fill_matches_reference(guards, block, dtype, up):
    for n in sizes(block):
        x = randn(n, n + 1, dtype)
        x[:: 5] = -0.0
        flag = torch.tensor([up, 3.0, -3.0], device=DEV)
        want = ref.flag_fill(x.clone(), flag.clone())
        got = tk.flag_fill(poisoned(guards, x), flag)
        assert torch.equal(got.isnan(), want.isnan())
        assert n == 0 or bool(got.isnan().all()) == (up > 0)
        if not up:  # untouched, bit for bit
            assert torch.equal(got.view(torch.int16 if x.element_size() == 2 else torch.int32),
                               want.view(torch.int16 if x.element_size() == 2 else torch.int32))
        assert torch.equal(flag, torch.tensor([up, 3.0, -3.0], device=DEV))
