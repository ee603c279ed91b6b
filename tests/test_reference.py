"""The pure-torch reference steps (the specification of the kernels)."""
import math

import pytest
import torch

from gradcomp.kernels import reference as ref


@pytest.mark.parametrize("n", [8, 64, 8 * 1001])
def test_bits_round_trip_and_size(n):
    bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
    packed = ref.pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == n // 8
    assert torch.equal(ref.unpack_bits(packed), bits)
    codes = torch.randint(0, 3, (n,), dtype=torch.uint8)
    p2 = ref.pack_2bit(codes)
    assert p2.numel() == n // 4 and torch.equal(ref.unpack_2bit(p2), codes)


def test_bit_order_is_lsb_first():
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    assert ref.pack_bits(bits).tolist() == [129, 2]


def test_onebit_matches_hand_computed_example():
    # two chunks of 8; chunk 1: positives {1, 3, 0} mean 4/3, negatives {-2, -4, -1, -1, -1} mean -9/5
    x = torch.tensor([1., -2, 3, -4, 0, -1, -1, -1, 5, 5, 5, 5, 5, 5, 5, 5])
    res = torch.zeros(16)
    bits, scales = ref.onebit_compress(x, res, chunk=8)
    assert bits.tolist() == [0b00010101, 0xFF]
    assert torch.allclose(scales, torch.tensor([[4 / 3, 5.0], [-9 / 5, 0.0]]))
    deq = torch.tensor([4 / 3, -1.8, 4 / 3, -1.8, 4 / 3, -1.8, -1.8, -1.8] + [5.0] * 8)
    assert torch.allclose(res, x - deq)
    out = torch.zeros(16)
    ref.onebit_decompress(bits.unsqueeze(0), scales.unsqueeze(0), 8, out)
    assert torch.allclose(out, deq)
    # error feedback: the residual enters the next quantization
    before = res.clone()
    bits2, _ = ref.onebit_compress(torch.zeros(16), res, chunk=8)
    assert ref.unpack_bits(bits2).tolist() == (before >= 0).tolist()


def test_ternary_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, generator=g)
    seg = torch.zeros(400, dtype=torch.int64)
    seg[200:] = 1
    scale = torch.stack([x[:200].abs().max(), x[200:].abs().max()])
    draws = 4000
    acc = torch.zeros(400)
    for s in range(draws):
        packed = ref.ternary_compress(x, None, scale, seg, seed=s)
        ref.ternary_decompress(packed.unsqueeze(0), scale.unsqueeze(0), seg, acc)
    mean = acc / draws
    # per-element std of one draw <= scale; of the mean <= scale / sqrt(draws): allow 5 sigma
    tol = 5 * scale[seg] / math.sqrt(draws)
    assert ((mean - x).abs() <= tol).all()
    # and a biased variant (deterministic sign * scale) would fail the same bound
    assert not ((torch.sign(x) * scale[seg] - x).abs() <= tol).all()


def test_ternary_residual_and_values():
    x = torch.tensor([0.5, -0.5, 1.0, 0.0])
    res = torch.zeros(4)
    packed = ref.ternary_compress(x, res, torch.tensor([1.0]), torch.zeros(4, dtype=torch.long), 3)
    codes = ref.unpack_2bit(packed)
    q = (codes == 1).float() - (codes == 2).float()
    assert torch.equal(res, x - q)
    assert codes[2] == 1 and codes[3] == 0  # |x| = scale always kept, 0 never


def test_ternary_is_reproducible_per_seed():
    x = torch.randn(1000)
    args = (torch.tensor([x.abs().max()]), torch.zeros(1000, dtype=torch.long))
    a = ref.ternary_compress(x, None, *args, seed=7)
    assert torch.equal(a, ref.ternary_compress(x, None, *args, seed=7))
    assert not torch.equal(a, ref.ternary_compress(x, None, *args, seed=8))


@pytest.mark.parametrize("n, k", [(1000, 10), (4097, 1), (50_000, 50)])
def test_select_topk_exact_when_threshold_brackets_k(n, k):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    true = torch.topk(x.abs(), k).indices
    thr = torch.topk(x.abs(), int(1.5 * k)).values.min()  # lets ~1.5k through
    vals, idx = ref.select_topk(x, thr, k, capacity=2 * k)
    assert idx.dtype == torch.int32
    assert set(idx.tolist()) == set(true.tolist())
    assert torch.equal(vals, x[idx.long()])


def test_select_topk_too_few_pads_with_zero_and_too_many_is_bounded():
    x = torch.arange(1.0, 101.0)
    vals, idx = ref.select_topk(x, torch.tensor(96.0), 10, capacity=20)  # only 5 pass
    assert sorted(vals[vals != 0].tolist()) == [96, 97, 98, 99, 100]
    out = ref.scatter_add(vals, idx, torch.zeros(100))
    assert torch.equal(out, torch.where(x >= 96, x, 0.0))
    vals, idx = ref.select_topk(x, torch.tensor(0.0), 10, capacity=20)  # all pass: first 20 kept
    assert sorted(vals.tolist()) == list(range(11, 21))
