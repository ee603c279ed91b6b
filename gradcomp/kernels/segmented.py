"""Per-parameter top-k of a whole bucket in a fixed number of ops (no loop over parameters).

A bucket holds many parameters and every choice is per parameter (k, the sampled threshold,
the candidate budget, the random sample), so that a parameter's result never depends on its
neighbours in the bucket. Written as one loop over parameters, that costs ~25 ops (on a GPU,
launches) per parameter. Here the parameters are described once per bucket layout by small
tables (:class:`SelectPlan`, cached), and each step runs a fixed sequence of batched torch
ops over the whole bucket, whatever its parameter count:

  1. Sample: m_p positions per parameter: a Weyl sequence (static) shifted by a random
     amount drawn from the parameter's seed, modulo its size -- for all parameters at once.
  2. Threshold: the ks_p-th largest sampled magnitude of each parameter, by ONE sort of the
     sample under the key (parameter, descending magnitude) (non-negative floats order like
     their bit patterns, so the key is an integer).
  3. Candidates: |y| >= threshold of its parameter; the first cap_p of each parameter, in
     index order, are compacted into the parameter's slots of a candidate buffer.
  4. Exact top k_p of each parameter's candidates: ONE sort of the buffer under the same key;
     parameter p's candidates then sit in its own cap_p positions, largest first; the first
     k_p of each are taken, put back in slot order (:func:`slot_order`: each parameter's
     values in index order) and gathered.

Steps 2 and 4 rank magnitudes. On the CPU each is one sort, as above. On the GPU each is a
segmented radix select (:func:`kth_largest`; Triton kernels ``segment_kth``,
``segment_take``): three passes of 11, 11 and 9 bits over the magnitudes' bit patterns,
each a histogram per parameter of its elements that match the digits found so far and a
search of its bins, give each parameter's k-th magnitude and how many of its k largest
equal it; the slots above it and the first such ties are kept, in slot order. No sort and
no host read: a sort of 64-bit keys is itself a radix sort, eight or more passes over every
element.

:func:`select_param` is the per-parameter reference (the same rules, one parameter at a
time): :func:`select` equals it bit for bit, value and index, for every parameter.
"""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field

import torch

from . import backend, implementation
from .work import scratch

# Candidate buffer = CAPACITY_FACTOR * k; the sampled threshold targets TARGET_FACTOR * k so
# that the count that passes (about 1.5k +- a few sqrt(k)) rarely overflows the buffer.
CAPACITY_FACTOR = 2
TARGET_FACTOR = 1.5
# The threshold is the MIN_SAMPLE_HITS-th largest sampled magnitude at least: its relative
# error is about 1/sqrt(MIN_SAMPLE_HITS), within what the 2x buffer absorbs.
MIN_SAMPLE_HITS = 32

_M64 = 0xFFFFFFFFFFFFFFFF
_LOW31 = 0x7FFFFFFF


_PHI = (math.sqrt(5) - 1) / 2


def shift(seed: int, n: int) -> int:
    """A parameter's random shift in [0, n) for this step, from its 64-bit seed (on the host,
    once per parameter and step: a splitmix64 finalizer)."""
    z = seed & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) % n if n else 0


def weyl(n: int, m: int) -> list[int]:
    """m points of the Weyl sequence floor(frac(i * phi) * n): spread evenly over [0, n) at
    every scale, and equidistributed modulo any period (phi is irrational), so a tensor's
    periodic structure (channels, kernel taps) cannot alias with it."""
    return [int(math.fmod(i * _PHI, 1.0) * n) for i in range(m)]


def sample_positions(seed: int, n: int, m: int, device=None) -> torch.Tensor:
    """The m sample positions in [0, n) of one parameter with ``seed`` (what :func:`select`
    draws for it): the Weyl points shifted by a random amount, modulo n. Each position is
    uniform over [0, n) (the shift is), and the m positions are spread evenly: a stratified
    sample, whose quantile estimate varies less than that of m independent draws."""
    base = torch.tensor(weyl(n, m), dtype=torch.int64, device=device)
    return (base + shift(seed, n)) % n


def budget(n: int, ratio: float, sample_ratio: float) -> tuple[int, int, int, int]:
    """(k, capacity, sample size m, sample rank ks) of a parameter of n elements; m = 0: every
    element is sent (k >= n)."""
    k = max(1, math.ceil(ratio * n))
    if k >= n:
        return n, n, 0, 0
    target = min(n, math.ceil(TARGET_FACTOR * k))
    capacity = min(n, CAPACITY_FACTOR * k)
    # enough samples that ~MIN_SAMPLE_HITS of them land above the threshold
    m = min(n, max(math.ceil(sample_ratio * n), math.ceil(MIN_SAMPLE_HITS * n / target)))
    ks = max(1, min(m, -(-target * m // n)))
    return k, capacity, m, ks


def _desc_key(mag: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """int64 keys ordering by (segment ascending, magnitude descending): ``base`` is
    ``(segment << 31) + 0x7FFFFFFF`` per element, mag >= 0 (a non-negative float orders like
    its bit pattern; NaN sorts first)."""
    bits = mag.view(torch.int32)
    if mag.device.type == "cpu":  # int64 - int32 casts element by element there: widen
        bits = bits.to(torch.int64)  # first (1.1M keys: 1.8 against 8.3 ms)
    return base - bits


def select_param(y: torch.Tensor, ratio: float, sample_ratio: float, seed: int):
    """Reference: (values, int64 indices into y) of about the ratio*n largest |y|, one
    parameter, and the sampled threshold (None when every element is sent). The threshold is
    the ks-th largest sampled magnitude; the candidates are the first ``capacity`` elements
    with |y| >= it, in index order; the result is the k largest candidates (ties: the lower
    index), in index order. Slots the candidates did not fill carry value 0 and index 0 and
    come last."""
    n = y.numel()
    k, capacity, m, ks = budget(n, ratio, sample_ratio)
    if m == 0:
        thr = None
        cand = torch.arange(n, device=y.device)
    else:
        s = y[sample_positions(seed, n, m, y.device)].abs()
        thr = torch.sort(s, descending=True, stable=True).values[ks - 1]
        cand = torch.nonzero(y.abs() >= thr).view(-1)[:capacity]
    val = torch.zeros(capacity, dtype=y.dtype, device=y.device)
    idx = torch.zeros(capacity, dtype=torch.int64, device=y.device)
    val[: cand.numel()] = y[cand]
    idx[: cand.numel()] = cand
    order = torch.sort(_desc_key(val.abs(), torch.full_like(idx, _LOW31)), stable=True).indices
    order = torch.sort(order[:k]).values  # in index order, unfilled slots last
    return val[order], idx[order], thr


@dataclass(frozen=True)
class SelectPlan:
    """A bucket's top-k tables (device tensors; built once per layout and ratio).

    Segments cover the bucket's n elements in order: one per selected parameter and one per
    gap between them (parameters sent otherwise). The sorted sample ends with two constants,
    a NaN (a gap's threshold: no element of a gap is ever a candidate) and a 0 (the threshold
    of a parameter that sends every element)."""

    seg_of: torch.Tensor      # (n,) int32 segment of each element (shared by a layout's plans)
    seg_len: tuple            # (S,) element count of each segment (ints: the CPU's broadcast)
    seg_start: torch.Tensor   # (S,) offset of each segment
    seg_prev: torch.Tensor    # (S,) the element before each segment (0 for one at 0) ...
    at_zero: torch.Tensor     # (S,) ... and whether there is none
    seg_thr: torch.Tensor     # (S,) place of each segment's threshold in the sorted sample
    param_seg: torch.Tensor   # (P,) segment of each parameter
    slot_base: torch.Tensor   # (S,) first candidate slot of each segment
    slot_end: torch.Tensor    # (S,) end of its candidate slots (= slot_base for a gap)
    slots: int                # candidate slots in all (C); slot C is the spill slot
    slot_key: torch.Tensor    # (C + 1,) sort base of each slot (its parameter; P: spill)
    take: torch.Tensor        # (K,) positions, in the sorted buffer, of the k_p best of each
    slot_param: torch.Tensor  # (C,) parameter of each slot
    slot_first: torch.Tensor  # (P + 1,) first slot of each parameter; then C
    take_first: torch.Tensor  # (P,) first of each parameter's k_p places in the result
    widest: int               # the most slots of one parameter
    slot_need: torch.Tensor   # (P,) k_p: how many of its slots each parameter sends
    sample_need: torch.Tensor  # (P,) ks_p: the rank of each parameter's sampled threshold
    thr_from: torch.Tensor    # (S,) each segment's threshold in cat(per parameter (P,), NaN, 0)
    sample_key: torch.Tensor  # (M + 2,) sort base of each sample (P: the two constants)
    sample_of: torch.Tensor   # (M,) parameter of each sample
    sample_base: torch.Tensor  # (M,) its Weyl point
    sample_n: torch.Tensor    # (M,) its parameter's element count
    sample_off: torch.Tensor  # (M,) its parameter's offset
    sample_start: torch.Tensor  # (P,) first sample of each parameter
    tail: torch.Tensor        # (2,) the constants NaN, 0
    sampled: tuple            # parameters that sample (the others send every element)
    # per thread and dtype: an (S,) buffer and its values broadcast over their segments
    # (stride-0 views of it, made once): :func:`per_element`'s CPU path
    broadcasts: dict = field(default_factory=dict, compare=False, repr=False)


@functools.lru_cache(maxsize=16)
def _segment_of(lengths: tuple, device) -> torch.Tensor:
    """(sum(lengths),) int32: the segment of each element. One per bucket layout (plans of
    other ratios share it): it is the one table as large as the bucket."""
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                   torch.tensor(lengths, dtype=torch.int64)).to(device)


def _key_base(segments: list[int]) -> list[int]:
    return [(s << 31) + _LOW31 for s in segments]


def topk_plan(layout: tuple, n: int, ratio: float, sample_ratio: float, device) -> SelectPlan:
    """The top-k tables of the parameters ``layout`` ((offset, numel) pairs in offset order)
    of a bucket of n elements, every one with :func:`budget`'s choices."""
    return plan(layout, tuple(budget(numel, ratio, sample_ratio) for _, numel in layout), n,
                device)


@functools.lru_cache(maxsize=256)
def plan(layout: tuple, budgets: tuple, n: int, device) -> SelectPlan:
    """The tables for the parameters ``layout`` ((offset, numel) pairs in offset order,
    disjoint) of a bucket of n elements, with per-parameter ``budgets`` (k, capacity, sample
    size m, sample rank ks): each parameter's sampled threshold is its ks-th largest sampled
    magnitude, or 0 (every element a candidate) where ks is 0."""
    P = len(layout)
    M = sum(b[2] for b in budgets)
    seg_len, seg_start, seg_thr, param_seg, slot_base, slot_end = [], [], [], [], [], []
    take, slot_seg, sampled, sample_start = [], [], [], []
    slot_first, take_first, slot_need, sample_need, thr_from = [], [], [], [], []
    sample_of, sample_base, sample_n, sample_off = [], [], [], []
    pos = slot = m_total = 0

    def segment(start, length, thr, cap, src):
        seg_len.append(length), seg_start.append(start), seg_thr.append(thr)
        slot_base.append(slot), slot_end.append(slot + cap), thr_from.append(src)

    for p, ((off, numel), (k, capacity, m, ks)) in enumerate(zip(layout, budgets)):
        if off < pos:
            raise ValueError(f"parameters overlap or are out of order at offset {off}")
        if off > pos:
            segment(pos, off - pos, M, 0, P)
        param_seg.append(len(seg_len))
        segment(off, numel, m_total + ks - 1 if ks else M + 1, capacity, p if ks else P + 1)
        take.extend(range(slot, slot + k))
        slot_first.append(slot), slot_need.append(k), sample_need.append(ks)
        take_first.append(len(take) - k)
        slot_seg.extend([p] * capacity)
        slot += capacity
        sample_start.append(m_total)
        sample_of.extend([p] * m), sample_base.extend(weyl(numel, m))
        sample_n.extend([numel] * m), sample_off.extend([off] * m)
        if ks:
            sampled.append(p)
        m_total += m
        pos = off + numel
    if pos < n:
        segment(pos, n - pos, M, 0, P)

    def t(v):
        return torch.tensor(v, dtype=torch.int64, device=device)

    return SelectPlan(
        _segment_of(tuple(seg_len), device), tuple(seg_len), t(seg_start),
        t([max(0, a - 1) for a in seg_start]),
        torch.tensor([a == 0 for a in seg_start], dtype=torch.bool, device=device),
        t(seg_thr), t(param_seg), t(slot_base), t(slot_end), slot, t(_key_base(slot_seg + [P])),
        t(take), t(slot_seg), t(slot_first + [slot]), t(take_first),
        max((e - b for b, e in zip(slot_base, slot_end)), default=0),
        t(slot_need), t(sample_need), t(thr_from),
        t(_key_base(sample_of + [P, P])), t(sample_of), t(sample_base), t(sample_n),
        t(sample_off), t(sample_start), torch.tensor([float("nan"), 0.0], device=device),
        tuple(sampled))


# :func:`kth_largest`'s passes, (shift, width): 11 + 11 + 9 bits cover a magnitude's 31
RADIX_PASSES = ((20, 11), (9, 11), (0, 9))


@functools.lru_cache(maxsize=8)
def check_passes(passes) -> int:
    """The bins per entity of the radix passes ``passes``, which must cover bits 30..0 of a
    magnitude's pattern, from the top, in widths of 1-11 bits (so that an entity that needs
    nothing ends with every digit the largest: t = 0x7FFFFFFF, taken by none)."""
    top = 31
    for shift, width in passes:
        if not 1 <= width <= 11 or shift + width != top:
            raise ValueError(f"radix passes {passes} must cover bits 30..0 from the top, "
                             f"1-11 bits each")
        top = shift
    if top != 0:
        raise ValueError(f"radix passes {passes} must end at bit 0")
    return 1 << max(w for _, w in passes)


def kth_largest(mag: torch.Tensor, ent: torch.Tensor, need: torch.Tensor, E: int):
    """Segmented radix select: for each entity e < E, (t_e, r_e), t_e the bits of the
    need_e-th largest |mag| of its elements (``ent == e``) and r_e how many of its need_e
    largest equal it (the others are above it). mag: (L,) fp32, ranked by the bits of |mag|
    (a non-negative float orders like its pattern; NaN above inf); ent: (L,) int64; need:
    (E,) int64 in [1, count of e] (0: t_e and r_e are meaningless). Three passes over the
    bits from the top (:data:`RADIX_PASSES`): a histogram of each entity's digit among its
    elements that match the digits found so far, and the digit where the count from the
    top reaches what is still needed -- no sort, no host read. The torch ops of it (any
    device); the Triton kernels' is the same function (kernels/triton/topk.py)."""
    check_passes(RADIX_PASSES)
    dev = mag.device
    b = mag.abs().view(torch.int32).to(torch.int64)
    prefix = torch.zeros(E, dtype=torch.int64, device=dev)
    ones = torch.ones(b.numel(), dtype=torch.int64, device=dev)
    for i, (shift, width) in enumerate(RADIX_PASSES):
        bins = 1 << width
        at = ent * bins + ((b >> shift) & (bins - 1))
        if i:  # only the elements that match the digits found so far
            at.masked_fill_((b >> (shift + width)) != prefix[ent], E * bins)
        h = torch.zeros(E * bins + 1, dtype=torch.int64, device=dev).index_add_(0, at, ones)
        h = h[:-1].view(E, bins)
        desc = h.flip(1).cumsum(1).flip(1)  # elements with this digit or a larger one
        d = (desc >= need[:, None]).sum(1).sub_(1).clamp_(min=0)
        above = torch.where(torch.arange(bins, device=dev) > d[:, None], h, 0).sum(1)
        need = need - above
        prefix = prefix * bins + d
    return prefix, need


def _kth(way: str, mag, ent, need, E):
    if way == "triton":
        check_passes(RADIX_PASSES)
        return implementation("segment_kth", mag, "triton")(mag, ent, need, E, RADIX_PASSES)
    return kth_largest(mag, ent, need, E)


def _rank_way(rank: str, x: torch.Tensor) -> str:
    """"sort" (torch.sort by (segment, magnitude): the CPU's way), "radix" (the
    :func:`kth_largest` torch ops), "triton" (its Triton kernels) or "auto" (the GPU's way
    where the Triton kernels run: triton; else sort). The same result every way."""
    if rank == "auto":
        return "triton" if backend("select_topk", x) == "triton" else "sort"
    return rank


def thresholds(x: torch.Tensor, pl: SelectPlan, shifts: torch.Tensor, rank: str = "auto"):
    """Step 2's thresholds (S,) alone (NaN for a gap, 0 where ks is 0), what :func:`sample`
    returns third; ``rank``: see :func:`_rank_way`."""
    rank = _rank_way(rank, x)
    if rank == "sort":
        return sample(x, pl, shifts)[2]
    if rank == "triton":  # the sample, the radix select, each segment's threshold gathered
        check_passes(RADIX_PASSES)
        return implementation("segment_thresholds", x, "triton")(
            x, pl.sample_base, pl.sample_of, shifts, pl.sample_n, pl.sample_off,
            pl.sample_need, pl.param_seg.numel(), RADIX_PASSES, pl.thr_from)
    s = x[_sample_at(pl, shifts)]
    t, _ = _kth(rank, s, pl.sample_of, pl.sample_need, pl.param_seg.numel())
    return torch.cat([t.to(torch.int32).view(torch.float32), pl.tail])[pl.thr_from]


def _sample_at(pl: SelectPlan, shifts: torch.Tensor) -> torch.Tensor:
    """(M,) the sample positions of every parameter: its Weyl points shifted, modulo its
    size, at its offset (the Triton way: ``segment_sample``)."""
    return (pl.sample_base + shifts[pl.sample_of]).remainder_(pl.sample_n).add_(pl.sample_off)


def sample(x: torch.Tensor, pl: SelectPlan, shifts: torch.Tensor):
    """Steps 1-2: (sorted keys (M + 2,), magnitudes sorted by them, each segment's sampled
    threshold (S,): NaN for a gap, 0 where ks is 0). Within a parameter the magnitudes run
    largest first; the two constants (NaN, 0) close the list. shifts: (P,) int64,
    :func:`shift` of each parameter's seed and size, in the plan's order."""
    mag = torch.cat([x[_sample_at(pl, shifts)].abs_(), pl.tail])
    keys, order = torch.sort(_desc_key(mag, pl.sample_key))
    mag = mag[order]
    return keys, mag, mag[pl.seg_thr]  # the two constants sort last: their places are fixed


def select(x: torch.Tensor, pl: SelectPlan, shifts: torch.Tensor, compact: str = "auto",
           rank: str = "auto"):
    """Every parameter of ``pl`` at once: (values (K,), int64 indices into x (K,), each
    segment's threshold (S,): ``[pl.param_seg]`` gives the parameters'), each parameter's k_p
    values in its own positions, equal to :func:`select_param` on it. shifts: see
    :func:`sample`; compact: see :func:`select_above`; rank: how steps 2 and 4 rank
    magnitudes (:func:`_rank_way`)."""
    if pl.slots == 0:  # nothing to select (every parameter empty)
        return (*select_above(x, pl, None), x.new_zeros(pl.seg_thr.numel()))
    thr = thresholds(x, pl, shifts, rank)
    return (*select_above(x, pl, thr, compact, rank), thr)


def select_above(x: torch.Tensor, pl: SelectPlan, thr: torch.Tensor, compact: str = "auto",
                 rank: str = "auto"):
    """Steps 3-4 with each segment's threshold ``thr`` (S,) (NaN: no candidate): (values (K,),
    int64 indices into x (K,)), the k_p largest of the first capacity_p elements with
    |x| >= thr of each parameter. ``compact``: "nonzero" (the CPU's way), "cumsum" (no host
    sync, in torch ops), "triton" (the same slots as "cumsum" in three Triton launches: the
    GPU's way) or "auto" (the GPU's way where the Triton kernels run). ``rank``: how the k
    largest candidates are found (:func:`_rank_way`)."""
    n, dev, C = x.numel(), x.device, pl.slots
    if C == 0:  # nothing to select (every parameter empty)
        return x.new_zeros(0), torch.zeros(0, dtype=torch.int64, device=dev)
    # 3: candidates, the first cap_p of each parameter in index order
    if compact == "auto":  # the GPU's way wherever the GPU's kernels run (tests: on the CPU)
        compact = "triton" if backend("select_topk", x) == "triton" else "nonzero"
    if compact == "triton" and _rank_way(rank, x) == "triton":  # steps 3-4 in one call
        check_passes(RADIX_PASSES)
        return implementation("segment_select", x, "triton")(
            x, thr, pl.seg_of, pl.seg_start, pl.slot_base, pl.slot_end, pl.slot_need,
            pl.slot_first, pl.take_first, pl.take.numel(), pl.slot_param, pl.widest,
            RADIX_PASSES)
    if compact == "triton":
        find = implementation("segment_candidates", x, "triton")
        val, idx = find(x, thr, pl.seg_of, pl.seg_start, pl.slot_base, pl.slot_end, C)
        return _take_largest(val, idx, pl, rank)
    # in reused work buffers (two fresh bucket-sized temporaries paid a page fault per 4 KB)
    mag = torch.abs(x, out=scratch("segmented.mag", n, x.dtype, dev))
    at = per_element(thr, pl, scratch("segmented.thr", n, thr.dtype, dev))
    mask = torch.ge(mag, at, out=scratch("segmented.mask", n, torch.bool, dev))
    if compact == "nonzero":
        cand = torch.nonzero(mask).view(-1)
        # (index_select, not indexing: the CPU's 1-D gather, 1.5-2x faster than aten::index)
        seg = torch.index_select(pl.seg_of, 0, cand)
        # slot = slot_base + (rank of the candidate within its segment)
        move = pl.slot_base - torch.searchsorted(cand, pl.seg_start)
        slot = torch.arange(cand.numel(), device=dev).add_(torch.index_select(move, 0, seg))
        slot.masked_fill_(slot >= torch.index_select(pl.slot_end, 0, seg), C)
        src_val, src_idx = torch.index_select(x, 0, cand), cand
    else:
        cs = torch.cumsum(mask, 0)  # candidates up to each element
        before = cs[pl.seg_prev].masked_fill_(pl.at_zero, 0)  # ... before each segment
        slot = cs.add_((pl.slot_base - 1 - before)[pl.seg_of])
        keep = mask & (slot < pl.slot_end[pl.seg_of])
        slot.masked_fill_(~keep, C)
        # dropped elements all land in the spill slot, whatever they hold
        src_val, src_idx = x, torch.arange(n, device=dev)
    val = torch.zeros(C + 1, dtype=x.dtype, device=dev).index_put_((slot,), src_val)
    idx = torch.zeros(C + 1, dtype=torch.int64, device=dev).index_put_((slot,), src_idx)
    return _take_largest(val, idx, pl, rank)


def per_element(v: torch.Tensor, pl: SelectPlan, out: torch.Tensor) -> torch.Tensor:
    """out (n,) = each element's segment's value of v (S,): ``v[pl.seg_of]``. On the CPU a
    cat of the values broadcast over their segments: stride-0 views of a small buffer, made
    once per plan and thread, so a call is two ops (v into the buffer, the cat) whatever the
    segment count, and reads no per-element index (11.2M elements: 4 against 12-18 ms for
    the gather by ``seg_of``)."""
    if v.device.type != "cpu" or not pl.seg_len:
        return torch.index_select(v, 0, pl.seg_of, out=out)
    key = (threading.get_ident(), v.dtype)  # one exchange at a time per thread (scratch)
    hit = pl.broadcasts.get(key)
    if hit is None:
        buf = torch.empty(len(pl.seg_len), dtype=v.dtype)
        hit = pl.broadcasts[key] = (buf, [s.expand(m) for s, m in zip(buf.split(1), pl.seg_len)])
    hit[0].copy_(v)
    return torch.cat(hit[1], out=out)


def _take_largest(val: torch.Tensor, idx: torch.Tensor, pl: SelectPlan, rank: str = "auto"):
    """Step 4 over the candidate slots (C + 1,): (values, indices) of each parameter's k_p
    largest (ties: the lower slot), in slot order. ``rank``: see :func:`_rank_way`."""
    rank = _rank_way(rank, val)
    if rank != "sort":  # each parameter's k_p-th largest, then the slots above it and ties
        C = pl.slots
        # the spill slot C is never taken
        t, ties = _kth(rank, val[:C], pl.slot_param, pl.slot_need, pl.slot_need.numel())
        if rank == "triton":
            take = implementation("segment_take", val, "triton")
            return take(val, idx, t, ties, pl.slot_first, pl.take_first, pl.take.numel(),
                        pl.slot_param, pl.widest)
        t, ties = t[pl.slot_param], ties[pl.slot_param]
        bits = val[:C].abs().view(torch.int32)
        eq = bits == t
        before = torch.cumsum(eq, 0).sub_(eq.to(torch.int64))  # ties in earlier slots ...
        before.sub_(torch.cat([before, before.new_zeros(1)])[pl.slot_first][pl.slot_param])
        keep = (bits > t).logical_or_(eq.logical_and_(before < ties))  # ... of this parameter
        order = kept_order(keep, pl.take.numel())
        return torch.index_select(val, 0, order), torch.index_select(idx, 0, order)
    # 4: one sort puts each parameter's candidates in its own slots, largest first (the
    # spill slot, whatever it holds, sorts after every parameter's: it is never taken)
    order = torch.sort(_desc_key(val.abs(), pl.slot_key), stable=True).indices
    order = torch.index_select(order, 0, pl.take)
    order = slot_order(order, val.numel())
    return torch.index_select(val, 0, order), torch.index_select(idx, 0, order)


def kept_order(keep: torch.Tensor, K: int, by_mask: bool | None = None) -> torch.Tensor:
    """(K,) the positions where ``keep`` (K of them) is true, in increasing order. ``by_mask``
    (default: on the CPU): ``nonzero``; else with no host read: each kept position goes to
    the place the count of kept positions before it says (the GPU's way)."""
    if by_mask is None:
        by_mask = keep.device.type == "cpu"
    if by_mask:
        return torch.nonzero(keep).view(-1)
    place = torch.cumsum(keep, 0).sub_(1).masked_fill_(~keep, K)
    order = torch.zeros(K + 1, dtype=torch.int64, device=keep.device)
    return order.index_put_((place,), torch.arange(keep.numel(), device=keep.device))[:K]


def slot_order(taken: torch.Tensor, slots: int, by_mask: bool | None = None) -> torch.Tensor:
    """The distinct slot positions ``taken`` in increasing order: each parameter's values come
    out in index order (its candidates fill its slots in index order, unfilled slots after),
    so the sparse writes that follow them (error feedback's update, the decoder's
    scatter-add) walk the bucket forward instead of jumping (on the CPU 15 against 4-5 ms for
    560k of 11.2M elements). ``by_mask`` (default: on the CPU): a mask and ``nonzero`` (a
    sort of 560k took ~30 ms there); else a sort (no host sync: the GPU's way). The same
    result either way."""
    if by_mask is None:
        by_mask = taken.device.type == "cpu"
    if by_mask:
        mask = torch.zeros(slots, dtype=torch.bool, device=taken.device).index_fill_(0, taken, True)
        return kept_order(mask, taken.numel(), by_mask=True)
    return torch.sort(taken).values
