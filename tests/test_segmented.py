"""The segmented codec: a bucket's parameters handled in a fixed number of ops, each with the
result the per-parameter reference gives it, whatever the bucket layout."""
import random

import pytest
import torch

from gradcomp.compressors.base import ParamSlice
from gradcomp.hooks import build_config
from gradcomp import State
from gradcomp.kernels import segmented as S
from conftest import lay_out


def random_layout(rng, sizes=(0, 1, 3, 17, 100, 1000, 5000, 40000)):
    """(offset, numel) pairs with gaps (parameters sent some other way) and the bucket size."""
    layout, pos = [], 0
    for _ in range(rng.randint(1, 12)):
        pos += rng.choice([0, 0, 5])
        n = rng.choice(sizes)
        layout.append((pos, n))
        pos += n
    return layout, pos + rng.choice([0, 7])


def test_per_element_broadcast_is_the_gather_by_segment_and_follows_new_values():
    """per_element's CPU path (cached stride-0 views of a small buffer, one cat) equals the
    gather ``v[seg_of]`` for layouts with gaps and empty parameters, NaN values included; a
    second call with other values (and another dtype) gets those, not the cached ones; and a
    call costs the same ops with 5 or 50 segments."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    rng = random.Random(1)
    for _ in range(10):
        layout, n = random_layout(rng)
        pl = S.plan(tuple(layout), tuple((1, 1, 0, 0) if m else (0, 0, 0, 0)
                                         for _, m in layout), n, torch.device("cpu"))
        for dtype in (torch.float32, torch.float64, torch.float32):
            v = torch.randn(len(pl.seg_len), dtype=dtype)
            v[::3] = float("nan")
            got = S.per_element(v, pl, torch.empty(n, dtype=dtype))
            assert torch.equal(got.isnan(), v[pl.seg_of.long()].isnan())
            assert torch.equal(got.nan_to_num(), v[pl.seg_of.long()].nan_to_num())
    counts = []
    for parts in (5, 50):
        layout = tuple((i * 100, 90) for i in range(parts))
        pl = S.plan(layout, ((1, 1, 0, 0),) * parts, parts * 100, torch.device("cpu"))
        v = torch.randn(len(pl.seg_len))
        S.per_element(v, pl, torch.empty(parts * 100))
        with Count() as mode:
            S.per_element(v, pl, torch.empty(parts * 100))
        counts.append(mode.n)
    assert counts[0] == counts[1] <= 3


@pytest.mark.parametrize("compact,rank,serial", [
    ("nonzero", "sort", None), ("cumsum", "radix", None), ("triton", "triton", 16),
    ("nonzero", "triton", 0)])
def test_segmented_select_equals_the_per_parameter_reference(compact, rank, serial,
                                                             monkeypatch):
    """Values, indices and thresholds of every parameter, bit for bit: tiny, empty and large
    parameters, gaps, ties (rounded values), ratios where k >= n (every element sent); the
    magnitudes ranked by sorts or by the segmented radix select (torch ops, Triton: its
    take by one program per parameter and, ``serial`` 0, over all slots at once). The
    Triton kernels with blocks of 256 elements: segments across blocks, blocks across
    segments."""
    if "triton" in (compact, rank):
        from gradcomp.kernels.triton import common, topk
        monkeypatch.setattr(common, "BLOCK", 256)
        monkeypatch.setattr(topk, "SERIAL_BLOCKS", serial)
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    # (the Triton interpreter runs a kernel ~100x slower than torch: fewer layouts, every
    # ratio still drawn, a third of them with ties)
    ratios = []
    for trial in range(16 if "triton" in (compact, rank) else 40):
        layout, n = random_layout(rng)
        x = torch.randn(n, generator=g)
        if trial % 3 == 0:
            x = torch.round(x * 3)  # many equal magnitudes: ties at the threshold
        ratio, sr = rng.choice([0.001, 0.01, 0.3, 1.0]), rng.choice([0.01, 0.5])
        ratios.append(ratio)
        seeds = [rng.getrandbits(62) for _ in layout]
        pl = S.topk_plan(tuple(layout), n, ratio, sr, torch.device("cpu"))
        shifts = torch.tensor([S.shift(s, m) for s, (_, m) in zip(seeds, layout)])
        vals, idx, thr = S.select(x, pl, shifts, compact, rank)
        at = 0
        for p, ((off, m), seed) in enumerate(zip(layout, seeds)):
            k = S.budget(m, ratio, sr)[0]
            want_v, want_i, want_t = S.select_param(x[off : off + m], ratio, sr, seed)
            v, i = vals[at : at + k], idx[at : at + k]
            assert torch.equal(v, want_v), (trial, p)
            # unused slots (value 0) carry index 0 in both; the others the same element
            assert torch.equal(torch.where(v != 0, i - off, 0), torch.where(want_v != 0, want_i, 0))
            assert thr[pl.param_seg[p]] == (0.0 if want_t is None else want_t)
            at += k
        assert at == vals.numel()
    assert set(ratios) == {0.001, 0.01, 0.3, 1.0}


@pytest.mark.parametrize("way,passes", [("radix", None), ("triton", None),
                                        ("triton", ((24, 7), (16, 8), (8, 8), (0, 8)))])
def test_radix_select_finds_each_entitys_kth_largest_and_its_ties(way, passes, monkeypatch):
    """kth_largest (torch ops) and its Triton kernels against a sort: for every entity the
    need-th largest bit pattern and how many of the need largest equal it, with ties, zeros,
    inf and NaN magnitudes, entities of one element, empty entities (need = 0: every digit
    the largest, r = 0), need = count; entities interleaved and in runs, across 64-element
    blocks; the default digit widths and 7/8/8/8 bits (what the GPU probe compares)."""
    if passes:
        monkeypatch.setattr(S, "RADIX_PASSES", passes)
    if way == "triton":
        from gradcomp.kernels.triton import common
        monkeypatch.setattr(common, "BLOCK", 64)
        kernel = S.implementation("segment_kth", torch.zeros(1), "triton")

        def fn(*args):
            return kernel(*args, S.RADIX_PASSES)
    else:
        fn = S.kth_largest
    g = torch.Generator().manual_seed(3)
    for trial in range(12):
        E, L = [(1, 1), (3, 50), (7, 400), (20, 1000)][trial % 4]
        mag = torch.randn(L, generator=g).abs()
        if trial % 2:
            mag = torch.round(mag * 2) / 2  # ties and zeros
        mag[torch.randint(0, L, (max(1, L // 50),), generator=g)] = float("inf")
        if trial % 3 == 0:
            mag[torch.randint(0, L, (max(1, L // 50),), generator=g)] = float("nan")
        ent = torch.randint(0, E, (L,), generator=g)
        if trial % 4 == 2:
            ent = ent.sort().values  # in runs, as the slots are
        bits = mag.view(torch.int32)
        count = torch.bincount(ent, minlength=E)
        need = (torch.rand(E, generator=g) * count).long() + 1
        need = torch.minimum(need, count)  # an empty entity needs 0
        sign = torch.where(torch.rand(L, generator=g) < 0.5, -1.0, 1.0)
        t, r = fn(mag * sign, ent, need, E)  # ranked by magnitude
        for e in range(E):
            if need[e] == 0:  # ends with every digit the largest: a take keeps none
                assert (int(t[e]), int(r[e])) == (0x7FFFFFFF, 0), (trial, e)
                continue
            mine = bits[ent == e].long().sort(descending=True).values
            want = mine[need[e] - 1]
            assert int(t[e]) == int(want), (trial, e)
            assert int(r[e]) == int((mine[: need[e]] == want).sum()), (trial, e)


def test_triton_steps_alone_equal_the_torch_ways(monkeypatch):
    """The Triton steps that segmented.py chains (segment_select, segment_thresholds) also run
    alone: segment_candidates gives the "cumsum" way's slots, segment_kth_at the gather of
    segment_kth's magnitudes, segment_take of segment_kth the radix way's take, bit for bit
    across 256-element blocks, a take over all slots too (SERIAL_BLOCKS 0)."""
    from gradcomp.kernels.triton import common, topk
    monkeypatch.setattr(common, "BLOCK", 256)
    monkeypatch.setattr(topk, "SERIAL_BLOCKS", 0)
    g = torch.Generator().manual_seed(2)
    layout = ((0, 3), (3, 2000), (2010, 1), (2011, 700), (2711, 0), (2720, 900))
    n = 3625
    x = torch.round(torch.randn(n, generator=g) * 3)  # ties at every threshold
    pl = S.topk_plan(layout, n, 0.05, 0.5, torch.device("cpu"))
    shifts = torch.tensor([S.shift(11 + p, m) for p, (_, m) in enumerate(layout)])
    thr = S.thresholds(x, pl, shifts, "sort")
    s = topk.segment_sample(x, pl.sample_base, pl.sample_of, shifts, pl.sample_n,
                            pl.sample_off)
    P = pl.param_seg.numel()
    t, _ = topk.segment_kth(s, pl.sample_of, pl.sample_need, P, S.RADIX_PASSES)
    at = topk.segment_kth_at(s, pl.sample_of, pl.sample_need, P, S.RADIX_PASSES, pl.thr_from)
    want_at = torch.cat([t.view(torch.float32), pl.tail])[pl.thr_from]
    assert torch.equal(at.view(torch.int32), want_at.view(torch.int32))
    assert torch.equal(at.nan_to_num(-1), thr.nan_to_num(-1))
    val, idx = topk.segment_candidates(x, thr, pl.seg_of, pl.seg_start, pl.slot_base,
                                       pl.slot_end, pl.slots)
    mask = x.abs() >= thr[pl.seg_of.long()]
    cs = torch.cumsum(mask, 0)
    before = cs[pl.seg_prev].masked_fill_(pl.at_zero, 0)
    slot = cs.add_((pl.slot_base - 1 - before)[pl.seg_of.long()])
    slot.masked_fill_(~(mask & (slot < pl.slot_end[pl.seg_of.long()])), pl.slots)
    want_val = torch.zeros(pl.slots + 1).index_put_((slot,), x)
    want_idx = torch.zeros(pl.slots + 1, dtype=torch.int64).index_put_((slot,), torch.arange(n))
    want_val[-1], want_idx[-1] = 0, 0
    assert torch.equal(val, want_val) and torch.equal(idx, want_idx)
    got = S._take_largest(val, idx, pl, "triton")  # segment_kth, then segment_take
    want = S._take_largest(val, idx, pl, "radix")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_select_returns_each_parameters_values_in_index_order():
    """Each parameter's k values come out in index order, unfilled slots (index 0) last, on
    both ways of ordering the slots (the CPU's mask, the GPU's sort), which agree."""
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    for trial in range(10):
        layout, n = random_layout(rng)
        x = torch.randn(n, generator=g)
        pl = S.topk_plan(tuple(layout), n, 0.3, 0.5, torch.device("cpu"))
        shifts = torch.tensor([S.shift(rng.getrandbits(62), m) for _, m in layout])
        vals, idx, _ = S.select(x, pl, shifts)
        at = 0
        for off, m in layout:
            k = S.budget(m, 0.3, 0.5)[0]
            i = idx[at : at + k]
            filled = int((i >= off).sum()) if m else 0
            assert torch.all(i[:filled] >= off) and torch.all(i[filled:] == 0), trial
            assert torch.all(i[1:filled] > i[: filled - 1]), trial
            at += k
    taken = torch.randperm(1000, generator=g)[:300]
    assert torch.equal(S.slot_order(taken, 1000, by_mask=True),
                       S.slot_order(taken, 1000, by_mask=False))
    assert torch.equal(S.slot_order(taken, 1000), taken.sort().values)
    keep = torch.zeros(1000, dtype=torch.bool).index_fill_(0, taken, True)
    assert torch.equal(S.kept_order(keep, 300, by_mask=False), taken.sort().values)
    assert torch.equal(S.kept_order(keep, 300, by_mask=True), taken.sort().values)


def test_select_takes_the_largest_and_bounds_the_overflow():
    """What the reference itself must do: with a threshold that lets everything through, the
    first `capacity` elements are the candidates and the k largest of them are sent."""
    y = torch.arange(1.0, 101.0)  # n=100, ratio 0.05: k=5, capacity 10
    v, i, thr = S.select_param(y, 0.05, 1.0, seed=3)
    assert thr is not None
    assert sorted(v.tolist()) == [96.0, 97.0, 98.0, 99.0, 100.0]  # the true top 5
    assert torch.equal(y[i], v)
    flat = torch.ones(100)  # every element at the threshold: the first 10 are candidates
    v, i, _ = S.select_param(flat, 0.05, 1.0, seed=3)
    assert torch.equal(i, torch.arange(5))


def test_sample_positions_cover_the_tensor_and_move_with_the_seed():
    a = S.sample_positions(1, 1000, 100)
    b = S.sample_positions(2, 1000, 100)
    assert a.min() >= 0 and a.max() < 1000 and len(set(a.tolist())) == 100
    assert not torch.equal(a, b)
    # evenly spread: every tenth of the tensor holds about a tenth of the sample
    counts = torch.bincount(a // 100, minlength=10)
    assert counts.min() >= 8 and counts.max() <= 12


def layouts_of(shapes, order, cut):
    """Two buckets of the parameters ``shapes`` in ``order``, cut after ``cut`` of them."""
    names = [shapes[i] for i in order]
    return [lay_out(names[:cut]), lay_out(names[cut:])]


@pytest.mark.parametrize("spec", ["topk:ratio=0.01,min_numel=64", "dgc:momentum=0.9,min_numel=64",
                                  "onebit:chunk=64,min_numel=64", "threshold:min_numel=64"])
def test_a_relayout_between_steps_changes_no_parameter_result(spec):
    """Three steps in one bucket layout, then three in another (other neighbours, other
    order, other offsets, as after DDP's bucket rebuild): every parameter's average and
    memory equal those of a run that kept the first layout."""
    shapes = [(f"p{i}", s) for i, s in enumerate([(40, 30), (7,), (300,), (16, 3, 3, 3), (5, 5),
                                                  (1000,), (2, 64), (33,)])]
    g = torch.Generator().manual_seed(1)
    grads = [{name: torch.randn(shape, generator=g).reshape(-1) for name, shape in shapes}
             for _ in range(6)]

    def run(layouts_per_step):
        name, cfg = build_config(spec, warmup="none")
        state = State(name, cfg)
        outs = []
        for step, layouts in enumerate(layouts_per_step):
            got = {}
            for b, layout in enumerate(layouts):
                x = torch.cat([grads[step][p.name] for p in layout])
                y = state.reduce(x, layout, bucket=b)
                got.update({p.name: y[p.offset : p.offset + p.numel].clone() for p in layout})
            outs.append(got)
        return outs, state.state_dict()

    first = layouts_of(shapes, range(8), 3)
    other = layouts_of(shapes, [5, 2, 7, 0, 6, 1, 4, 3], 5)
    a, sa = run([first] * 6)
    b, sb = run([first] * 3 + [other] * 3)
    for step in range(6):
        for name, _ in shapes:
            assert torch.equal(a[step][name], b[step][name]), (step, name)
    mem_a, mem_b = sa["memory"], sb["memory"]
    assert mem_a.keys() == mem_b.keys()
    for kind in mem_a:
        for slot in mem_a[kind]:
            for name, t in mem_a[kind][slot].items():
                assert torch.equal(t, mem_b[kind][slot][name]), (kind, slot, name)


def test_dgc_clips_each_parameter_by_its_own_norm():
    """Local gradient clipping (DGC's section 3.2) per parameter: at ratio 1 without momentum
    the average at W=1 is each parameter's gradient scaled to at most ``clip`` in L2 norm;
    a bucket's gaps (none here) and the small parameter's own scale stay its own."""
    name, cfg = build_config("dgc:ratio=1,clip=1.0,min_numel=1", warmup="none")
    state = State(name, cfg)
    g = torch.Generator().manual_seed(0)
    big, small = torch.randn(500, generator=g) * 3, torch.randn(20, generator=g) * 0.01
    layout = [ParamSlice("a", (500,), 0, 500), ParamSlice("b", (20,), 500, 20)]
    out = state.reduce(torch.cat([big, small]), layout)
    torch.testing.assert_close(out[:500], big / big.norm(), rtol=1e-5, atol=1e-7)
    assert torch.equal(out[500:], small)  # already under the limit: untouched


def test_dgc_segment_norms_by_views_the_gpus_path_equals_the_segment_sums():
    """DGC's clip norms: the GPU's multi-tensor norm over the segments' views (run here on
    CPU tensors) against the CPU's segment reduction of x * x, gaps and an empty parameter
    included, within float32 roundings."""
    from gradcomp.compressors.dgc import _lengths, segment_norms
    x = torch.randn(3000, generator=torch.Generator().manual_seed(1)) * 2
    lengths, gap, sizes = _lengths(((10, 1000), (1010, 0), (1500, 900)), 3000, x.device)
    assert sizes == (10, 1000, 0, 490, 900, 600) and gap.tolist() == [1, 0, 0, 1, 0, 1]
    a = segment_norms(x, lengths, sizes, by_views=False)
    b = segment_norms(x, lengths, sizes, by_views=True)
    assert torch.equal(segment_norms(x, lengths, sizes), a) and b[2] == 0  # the CPU: sums
    torch.testing.assert_close(b, a, rtol=1e-6, atol=0)
    torch.testing.assert_close(b, torch.stack([t.norm() for t in x.split(list(sizes))]))


# Methods whose exchange is segmented (a fixed op count per bucket), with their launch
# budget: the codec issue's 60; threshold's adaptive tau, sign codes and per-sender decode
# take ~90 (bench/RESULTS.md, "Ops per bucket exchange"); onebit's correction of partly padded chunks
# (compressors/onebit.py, unpad: ~12 launches per phase, whatever the tensor count) 64. Each
# also pays the inf/NaN guard's device-side flag and its copy to host memory (read a step
# late: no host wait) and the declared messages' packing and contiguous fields
# (compressors/wire.py): 3 for a sparse message, 14 for onebit's two.
# topk and dgc: no sort left (a torch.sort, counted here as one launch, is a radix sort of
# 64-bit keys on a GPU: eight or more passes); two radix selects of 7 launches replace them
SEGMENTED = {"topk": 67, "dgc": 67, "onebit": 79, "threshold": 99}


@pytest.mark.parametrize("spec", list(SEGMENTED))
def test_op_count_does_not_grow_with_the_tensor_count(spec):
    """The codec issue's check, as a count: one bucket of 1M elements cut into 160 tensors
    costs at most 1.5x the aten ops of the same bucket cut into 16 (it was ~9x with a loop
    over parameters), and on the GPU's path (the Triton kernels, interpreted here) at most
    its budget of launches either way."""
    from gradcomp_bench import bench_ops
    few = bench_ops.buckets(bench_ops.even_shapes(2**20, 16), 2**40)[0]
    many = bench_ops.buckets(bench_ops.even_shapes(2**20, 160), 2**40)[0]
    assert bench_ops.count(spec, many) <= 1.5 * bench_ops.count(spec, few)
    for layout in (few, many):
        assert bench_ops.count(spec, layout, launches=True) <= SEGMENTED[spec]


@pytest.mark.parametrize("spec", ["topk:ratio=0.05,min_numel=64", "dgc:ratio=0.05,min_numel=64"])
@pytest.mark.parametrize("grad_dtype,option,width", [
    (torch.float32, "auto", 4), (torch.float16, "auto", 2), (torch.bfloat16, "auto", 2),
    (torch.float32, "fp16", 2), (torch.float32, "bf16", 2), (torch.float16, "fp32", 4)])
def test_sparse_values_travel_in_two_bytes_and_memory_keeps_the_rounding(spec, grad_dtype,
                                                                         option, width):
    """fp16/bf16 gradients (or value_dtype=fp16|bf16) send 2-byte values: 6 bytes per element
    instead of 8, counted in stats; the result is the rounded values, and the memory holds
    exactly what rounding took (gradient == result + memory, element for element). Values
    beyond fp16's range are clamped, never sent as inf."""
    name, cfg = build_config(spec, value_dtype=option, warmup="none")
    state = State(name, cfg)
    g = torch.Generator().manual_seed(3)
    n = 4000
    x = (torch.randn(n, generator=g) * 3).to(grad_dtype)
    x[7] = 60000.0 if grad_dtype == torch.float16 else 1e6  # fp16 max is 65504
    layout = [ParamSlice("w", (n,), 0, n)]
    out = state.reduce(x.clone(), layout)
    assert out.dtype == grad_dtype and torch.isfinite(out).all()
    k = 200  # ratio 0.05 of 4000
    assert state.stats()["sent_bytes"] == k * (4 + width) + 12  # + the inf/NaN flag, step check
    slot = "residual" if name == "topk" else "accumulation"
    mem = state.state_dict()["memory"]["flat"][slot]["w"]
    sent = out.float()
    if grad_dtype != torch.float32 and width == 4:
        return  # fp32 values: the result is rounded to the gradient's dtype on the way back
    exact = torch.zeros(n)
    exact[sent != 0] = sent[sent != 0]
    torch.testing.assert_close(exact + mem, x.float(), rtol=0, atol=0)
    if width == 2:
        wire = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(option, grad_dtype)
        nz = sent[sent != 0]
        assert torch.equal(nz, nz.to(wire).float())  # what arrives is representable
        assert sent.abs().max() <= torch.finfo(wire).max


# ------------------------------------------------------------------ runs (one cat per move)
def test_runs_lay_contiguous_pieces_with_zero_gaps_as_an_index_copy_would():
    from gradcomp.compressors.base import Runs
    g = torch.Generator().manual_seed(0)
    src = torch.randn(100, generator=g)
    runs = [(10, 50, 7), (0, 3, 5), (40, 20, 0), (60, 90, 10), (30, 70, 1)]  # any order
    out = torch.full((100,), 9.0)
    Runs(runs, 100, 100)(src, out)
    want = torch.zeros(100)
    for s, d, n in runs:
        want[d : d + n] = src[s : s + n]
    assert torch.equal(out, want)  # every element written: the gaps 0, not left as they were
    assert torch.equal(Runs([], 100, 5)(src, torch.zeros(5)), torch.zeros(5))
    for bad in ([(0, 0, 5), (10, 3, 5)], [(0, 0, 5), (3, 10, 5)]):  # destinations, sources
        with pytest.raises(ValueError, match="runs overlap"):
            Runs(bad, 100, 100)
    with pytest.raises(ValueError, match="run of 5 from 98 to 0 lies outside the source"):
        Runs([(98, 0, 5)], 100, 100)


@pytest.mark.parametrize("W", [1, 2, 3, 5])
def test_onebits_part_layout_by_runs_equals_it_by_indices(W, monkeypatch):
    """The 1-bit part layout moves by runs (one cat) on the CPU; beyond MAX_RUNS, and on a
    GPU, by per-element indices: the same elements either way, dense parameters and the
    padding 0."""
    import gradcomp.compressors.onebit as onebit
    layout = ((0, 700), (700, 5), (705, 64), (800, 1000))  # 769..800: a dense parameter
    n, chunk = 1800, 8
    onebit._parts.cache_clear()
    by_runs = onebit._parts(layout, n, W, W - 1, chunk, torch.device("cpu"))
    monkeypatch.setattr(onebit, "MAX_RUNS", 0)
    onebit._parts.cache_clear()
    by_index = onebit._parts(layout, n, W, W - 1, chunk, torch.device("cpu"))
    onebit._parts.cache_clear()
    assert by_runs.runs(torch.zeros(1)) and not by_index.runs(torch.zeros(1))
    x = torch.randn(n, generator=torch.Generator().manual_seed(W))
    a, b = by_runs.spread(x, "t.a").clone(), by_index.spread(x, "t.b").clone()
    assert torch.equal(a, b)
    assert torch.equal(by_runs.gather(a), by_index.gather(b))
    kept = by_runs.gather(a)
    assert torch.equal(kept[769:800], torch.zeros(31)) and torch.equal(kept[:769], x[:769])
    part = by_runs.part
    mine = by_runs.own_part(x, torch.full((part,), 5.0))
    assert torch.equal(mine, by_index.own_part(x, torch.full((part,), 5.0)))
    e_runs, e_index = torch.zeros(n), torch.zeros(n)  # the second memory: 0 but its own part
    by_runs.own_back(mine * 2, e_runs)
    by_index.own_back(mine * 2, e_index)
    assert torch.equal(e_runs, e_index) and e_runs.count_nonzero() > 0
