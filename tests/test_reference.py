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


def test_philox_matches_the_random123_known_answer():
    # Philox4x32-10, counter 0 and key 0: first output word 0x6627e8d5 (Random123's
    # kat_vectors); tl.rand takes it as int32 and scales it by 4.6566127342e-10 in fp32
    u = ref.philox_uniform(0, torch.tensor([0]))
    want = torch.tensor([0x6627E8D5], dtype=torch.int64).float() * torch.tensor(4.6566127342e-10)
    assert torch.equal(u, want)


def test_philox_words_match_the_random123_known_answer_and_feed_four_elements_each():
    # the four output words for counter 0, key 0: 6627e8d5 e169c58d bc57ac4c 9b00dbd8;
    # TernGrad's element j takes word j % 4 of counter j // 4
    words = torch.tensor([0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8], dtype=torch.int64)
    got = ref.philox_uniform(0, torch.zeros(4, dtype=torch.int64), torch.arange(4))
    assert torch.equal(got, ref.word_uniform(words))
    assert torch.equal(got[0], ref.philox_uniform(0, torch.tensor([0]))[0])  # word 0: tl.rand
    u = ref.ternary_uniforms(7, None, None, 12, "cpu")
    ctr = torch.arange(3).repeat_interleave(4)
    assert torch.equal(u, ref.philox_uniform(7, ctr, torch.arange(12) % 4))
    assert u.unique().numel() == 12


def test_philox_stream_is_uniform_and_seeded():
    n = 200_000
    u = ref.uniform(123, n, "cpu")
    assert 0 <= u.min() and u.max() < 1
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert ((hist - n / 10).abs() < 5 * math.sqrt(n / 10)).all()  # 5 sigma per bin
    assert not torch.equal(u[:100], ref.uniform(124, 100, "cpu"))
    # seeds per element: each element draws from its own seed's stream
    seeds = torch.tensor([5, 2**40 + 9]).repeat_interleave(50)
    ctr = torch.arange(100) % 50
    got = ref.philox_uniform(seeds, ctr)
    assert torch.equal(got[:50], ref.uniform(5, 50, "cpu"))
    assert torch.equal(got[50:], ref.uniform(2**40 + 9, 50, "cpu"))


def test_ternary_per_segment_streams_start_at_each_segment():
    # per-segment seeds: a segment draws tl.rand(seed[k], i - start[k]), so its codes are
    # those of the segment compressed alone with that seed (with one seed over the whole
    # tensor they would depend on the segment's place)
    g = torch.Generator().manual_seed(2)
    lens = [8, 4, 100]
    x = torch.randn(sum(lens), generator=g)
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    scale = torch.zeros(3).scatter_reduce_(0, seg, x.abs(), "amax")
    seeds = torch.tensor([3, 4, 5])
    starts = torch.tensor([0, 8, 12])
    codes = ref.unpack_2bit(ref.ternary_compress(x, None, scale, seg, seeds, starts))
    for k, (a, m) in enumerate(zip(starts.tolist(), lens)):
        alone = ref.ternary_compress(x[a : a + m], None, scale[k : k + 1],
                                     torch.zeros(m, dtype=torch.long), int(seeds[k]))
        assert torch.equal(codes[a : a + m], ref.unpack_2bit(alone))
    whole = ref.unpack_2bit(ref.ternary_compress(x, None, scale, seg, 3))
    assert not torch.equal(whole[12:], codes[12:])
    with pytest.raises(ValueError, match="starts"):
        ref.ternary_compress(x, None, scale, seg, seeds)
