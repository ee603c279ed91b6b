"""The CPU path of the 1-bit steps and TernGrad's decoder (gradcomp.kernels.cpu):
bit-identical to the reference.

Blocks are shrunk to a few chunks so that every size below runs over several blocks and a
partial last block; sizes cover one block +- one chunk and the small sizes the path hands to
the reference."""
import pytest
import torch

from gradcomp import kernels
from gradcomp.kernels import cpu
from gradcomp.kernels import reference as ref


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(cpu, "BLOCK", 3 * 1024)
    monkeypatch.setattr(cpu, "MIN_NUMEL", 0)


def grid(chunk):
    per_block = cpu._chunks_per_block(chunk)
    counts = {1, 2, per_block - 1, per_block, per_block + 1, 2 * per_block + 3}
    return [chunk * c for c in sorted(counts) if c >= 1]


def values(n, seed):
    """Gaussian values with exact zeros, negative zeros and whole chunks of one sign."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[::7] = 0.0
    x[3::11] = -0.0
    x[: min(n, 16)] = x[: min(n, 16)].abs()
    return x


@pytest.mark.parametrize("chunk", [8, 24, 1024])
@pytest.mark.parametrize("with_residual", [True, False])
def test_onebit_compress_is_bit_identical(chunk, with_residual):
    for i, n in enumerate(grid(chunk)):
        x = values(n, i)
        r = values(n, 100 + i) * 0.1 if with_residual else None
        want_r = r.clone() if with_residual else None
        want_bits, want_scales = ref.onebit_compress(x, want_r, chunk)
        bits, scales = cpu.onebit_compress(x, r, chunk)
        assert torch.equal(bits, want_bits), n
        assert torch.equal(scales, want_scales), n
        if with_residual:
            assert torch.equal(r, want_r), n


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_onebit_compress_non_finite_blocks_take_the_reference_selection(bad):
    chunk = 8
    n = chunk * 3 * 1024 // chunk * 2  # two blocks
    x = values(n, 0)
    x[5] = bad  # one chunk of the first block; the second block stays finite
    r = values(n, 1)
    want_r = r.clone()
    want = ref.onebit_compress(x, want_r, chunk)
    got = cpu.onebit_compress(x, r, chunk)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(r, want_r, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(r[chunk:]).all()  # only the chunk that held the value is poisoned


@pytest.mark.parametrize("chunk", [8, 1024])
@pytest.mark.parametrize("W", [1, 2, 3])
@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_onebit_decompress_is_bit_identical(chunk, W, alpha):
    for i, n in enumerate(grid(chunk)):
        g = torch.Generator().manual_seed(i)
        bits = torch.randint(0, 256, (W, n // 8), generator=g, dtype=torch.uint8)
        scales = torch.randn(W, 2, n // chunk, generator=g)
        out = torch.randn(n, generator=g)
        want = ref.onebit_decompress(bits, scales, chunk, out.clone(), alpha)
        got = cpu.onebit_decompress(bits, scales, chunk, out, alpha)
        assert got is out
        assert torch.equal(got, want), (n, W, alpha)


def test_onebit_decompress_non_finite_scales():
    chunk, n, W = 8, 8 * 1000, 2
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 256, (W, n // 8), generator=g, dtype=torch.uint8)
    scales = torch.randn(W, 2, n // chunk, generator=g)
    scales[1, 0, 3] = float("inf")
    want = ref.onebit_decompress(bits, scales, chunk, torch.zeros(n))
    got = cpu.onebit_decompress(bits, scales, chunk, torch.zeros(n))
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_round_trip_with_the_reference_decoder():
    # what a CPU rank compresses, a rank on the reference (or a GPU) decodes, and vice versa
    chunk, n = 1024, 1024 * 7
    x, r = values(n, 3), values(n, 4)
    bits, scales = cpu.onebit_compress(x, r, chunk)
    a = ref.onebit_decompress(bits.unsqueeze(0), scales.unsqueeze(0), chunk, torch.zeros(n))
    b = cpu.onebit_decompress(bits.unsqueeze(0), scales.unsqueeze(0), chunk, torch.zeros(n))
    assert torch.equal(a, b)
    want = (x + values(n, 4)).double()
    torch.testing.assert_close(a.double() + r.double(), want, rtol=0, atol=1e-5)


def test_refuses_non_contiguous_input():
    x = torch.randn(2048, 2)[:, 0]
    with pytest.raises(ValueError, match="flat contiguous"):
        cpu.onebit_compress(x, None, 8)


def test_dispatch_uses_the_cpu_path_unless_the_reference_is_forced(monkeypatch):
    calls = []
    real = cpu.onebit_compress
    monkeypatch.setattr(cpu, "onebit_compress", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(64)
    monkeypatch.delenv("GRADCOMP_KERNELS", raising=False)
    kernels.onebit_compress(x, None, 8)
    assert calls == [1]
    monkeypatch.setenv("GRADCOMP_KERNELS", "reference")
    kernels.onebit_compress(x, None, 8)
    assert calls == [1]


# --------------------------------------------------------------------------- TernGrad
@pytest.mark.parametrize("nseg", [1, 3])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_ternary_decompress_is_bit_identical(nseg, W):
    for i, n in enumerate([8, 3 * 1024, 7 * 1024 + 12]):
        g = torch.Generator().manual_seed(i)
        packed = torch.randint(0, 256, (W, n // 4), generator=g, dtype=torch.uint8)  # code 3 too
        scale = torch.rand(W, nseg, generator=g)
        seg = torch.sort(torch.randint(0, nseg, (n,), generator=g)).values
        out = torch.randn(n, generator=g)
        want = ref.ternary_decompress(packed, scale, seg, out.clone(), 0.5)
        got = cpu.ternary_decompress(packed, scale, seg, out, 0.5)
        assert got is out
        assert torch.equal(got, want), (n, W)


@pytest.mark.parametrize("path", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("W,alpha", [(1, 1.0), (3, 0.5)])
def test_decoders_overwriting_equal_a_zero_out_bit_for_bit(monkeypatch, path, W, alpha):
    """accumulate=False (what the exchanges use for their fresh buffers): out's garbage is
    not read, and the result is that of a zero-filled out, bit for bit, -0.0 decoded as the
    +0.0 that 0 + (-0.0) gives (the Triton decoders write it in the same launch: no zero
    fill before them on a GPU)."""
    if path == "triton":
        pytest.importorskip("triton")
        from gradcomp.kernels import triton as tk
        monkeypatch.setattr(tk.common, "BLOCK", 64)  # many programs, their edges
    monkeypatch.setenv("GRADCOMP_KERNELS", path)
    chunk = 8
    for i, n in enumerate(grid(chunk)):
        g = torch.Generator().manual_seed(i)
        bits = torch.randint(0, 256, (W, n // 8), generator=g, dtype=torch.uint8)
        scales = torch.randn(W, 2, n // chunk, generator=g)
        scales[:, :, ::3] = -0.0
        want = ref.onebit_decompress(bits, scales, chunk, torch.zeros(n), alpha)
        got = kernels.onebit_decompress(bits, scales, chunk, torch.full((n,), float("nan")),
                                        alpha, accumulate=False)
        assert torch.equal(got, want) and not got.signbit()[got == 0].any(), (n, W)
        packed = torch.randint(0, 256, (W, n // 4), generator=g, dtype=torch.uint8)
        scale = torch.rand(W, 2, generator=g)
        scale[0, 1] = -0.0
        seg = torch.sort(torch.randint(0, 2, (n,), generator=g)).values
        want = ref.ternary_decompress(packed, scale, seg, torch.zeros(n), alpha)
        got = kernels.ternary_decompress(packed, scale, seg, torch.full((n,), float("nan")),
                                         alpha, accumulate=False)
        assert torch.equal(got, want) and not got.signbit()[got == 0].any(), (n, W)
