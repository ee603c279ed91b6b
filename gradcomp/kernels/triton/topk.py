"""The sparse methods' Triton kernels (compressors/topk.py, dgc.py, threshold.py):
select_topk and scatter_add, as kernels/reference.py specifies them; the segmented top-k's
candidate step segment_candidates (kernels/segmented.py's "cumsum" way) and its ranking on
the GPU, segment_sample / segment_kth / segment_take (segmented.thresholds' sample,
segmented.kth_largest, segmented._take_largest's radix way), and the same chained in fewer
launches: segment_kth_at, segment_thresholds, segment_select (segmented.py's Triton way)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import common as c


# --------------------------------------------------------------------------- top-k select
@triton.jit
def _count_kernel(
    x_ptr,       # (n,) x                                   reads 4n
    thr_ptr,     # () threshold                             reads 4
    counts_ptr,  # (nblocks,) int32 candidates per block    writes 4n/BLOCK
    n,
    BLOCK_: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    thr = tl.load(thr_ptr).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    hit = (tl.abs(x) >= thr) & mask
    tl.store(counts_ptr + pid, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _compact_kernel(
    x_ptr,      # (n,) x                                           reads <= 4n
    thr_ptr,    # () threshold                                     reads 4
    start_ptr,  # (nblocks,) int64 exclusive prefix sum of counts  reads 8n/BLOCK
    val_ptr,    # (capacity,) fp32 candidate values, zeroed        writes <= 4 capacity
    idx_ptr,    # (capacity,) int32 candidate indices, zeroed      writes <= 4 capacity
    n, capacity,
    BLOCK_: tl.constexpr,
):
    pid = tl.program_id(0)
    base = tl.load(start_ptr + pid)
    if base < capacity:  # blocks whose candidates all fall past the buffer read nothing more
        offs = pid.to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
        mask = offs < n
        thr = tl.load(thr_ptr).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        hit = (tl.abs(x) >= thr) & mask
        slot = base + tl.cumsum(hit.to(tl.int32), axis=0) - 1  # index order within the block
        keep = hit & (slot < capacity)
        tl.store(val_ptr + slot, x, mask=keep)
        tl.store(idx_ptr + slot, offs.to(tl.int32), mask=keep)


def select_topk(x: torch.Tensor, threshold: torch.Tensor, k: int, capacity: int):
    """See :func:`gradcomp.kernels.reference.select_topk`: the same candidate buffer (the first
    ``capacity`` elements with |x| >= threshold in index order), so the same output.
    Reads 4n twice (at most), writes 8 capacity; then top-k over the buffer."""
    c.check_flat(x)
    n = x.numel()
    if not 0 <= k <= capacity:
        raise ValueError(f"need 0 <= k <= capacity, got k={k}, capacity={capacity}")
    if n >= 2**31:
        raise ValueError(f"indices are int32: x must have < 2^31 elements, got {n}")
    if not torch.is_tensor(threshold):
        threshold = torch.tensor(float(threshold), dtype=torch.float32, device=x.device)
    cand_val = c.alloc((capacity,), torch.float32, x.device).zero_()
    cand_idx = c.alloc((capacity,), torch.int32, x.device).zero_()
    if n and capacity:
        nblocks = triton.cdiv(n, c.BLOCK)
        counts = torch.empty(nblocks, dtype=torch.int32, device=x.device)
        _count_kernel[(nblocks,)](x, threshold, counts, n, BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
        start = torch.cumsum(counts, 0, dtype=torch.int64) - counts  # exclusive scan, tiny
        _compact_kernel[(nblocks,)](x, threshold, start, cand_val, cand_idx, n, capacity,
                                    BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    top = torch.topk(cand_val.abs(), k, sorted=False).indices
    vals = cand_val[top]
    idx = torch.where(vals != 0, cand_idx[top], 0)
    return vals, idx.to(torch.int32)


# --------------------------------------------------------------------------- scatter-add
@triton.jit
def _scatter_add_kernel(
    val_ptr,  # (m,) values                         reads 4m (fp32)
    idx_ptr,  # (m,) int32/int64 indices into out   reads 4m (int32)
    out_ptr,  # (n,) accumulator                    atomic read-modify-write 4m + 4m
    m, n, alpha,
    BLOCK_: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < m
    v = tl.load(val_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    i = tl.load(idx_ptr + offs, mask=mask, other=0)
    ok = mask & (i >= 0) & (i < n)  # an out-of-range index is dropped, never written
    tl.atomic_add(out_ptr + i, v * alpha, mask=ok, sem="relaxed")


def scatter_add(values: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                alpha: float = 1.0) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.scatter_add`. Duplicates accumulate (atomics, so
    their order, hence the last bits of the sum, may vary from run to run on a GPU). Indices
    outside [0, n) are dropped where the reference raises: checking would need a host sync."""
    c.check_flat(out, "out")
    c.check_contiguous(values, "values")
    c.check_contiguous(indices, "indices")
    m = values.numel()
    if indices.numel() != m:
        raise ValueError(f"values has {m} elements, indices {indices.numel()}")
    if m == 0:
        return out
    _scatter_add_kernel[(triton.cdiv(m, c.BLOCK),)](
        values.view(-1), indices.view(-1), out, m, out.numel(), float(alpha),
        BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    return out


# --------------------------------------------------------------------------- segmented candidates
# Step 3 of the segmented top-k (kernels/segmented.py, ``select_above``): the first cap_p
# elements with |x| >= thr of each segment, in index order, into the segment's candidate
# slots. Three launches, where the torch path takes ~20 ops: a count per block (which also
# records each segment's count within its first block and zeroes the slots), one program's
# exclusive scan of the tiny per-block counts, a compaction; the same slots as its "cumsum"
# way.
@triton.jit
def _excl_scan_kernel(
    counts_ptr,  # (nblocks,) int64 counts per block: replaced by the counts before each block
    nblocks,
    BLOCK_: tl.constexpr,
):
    carry = tl.zeros([], tl.int64)
    for start in range(0, nblocks, BLOCK_):  # one program: the counts are few
        offs = start + tl.arange(0, BLOCK_)
        mask = offs < nblocks
        cnt = tl.load(counts_ptr + offs, mask=mask, other=0)
        tl.store(counts_ptr + offs, carry + tl.cumsum(cnt, axis=0) - cnt, mask=mask)
        carry += tl.sum(cnt, axis=0)


def _excl_scan(counts: torch.Tensor) -> torch.Tensor:
    """counts (int64) in place: the exclusive prefix sum, in one launch of one program."""
    _excl_scan_kernel[(1,)](counts, counts.numel(), BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    return counts


@triton.jit
def _seg_hits(x_ptr, thr_ptr, seg_ptr, offs, mask):
    """Per element: its value, its segment, whether |x| >= its segment's threshold."""
    xv = tl.load(x_ptr + offs, mask=mask, other=0.0)
    seg = tl.load(seg_ptr + offs, mask=mask, other=0)
    t = tl.load(thr_ptr + seg, mask=mask, other=0.0)
    return xv, seg, (tl.abs(xv.to(tl.float32)) >= t) & mask


@triton.jit
def _seg_count_kernel(
    x_ptr,        # (n,) x                                          reads 4n
    thr_ptr,      # (S,) fp32 threshold per segment (NaN: no candidate)
    seg_ptr,      # (n,) int32 segment of each element              reads 4n
    counts_ptr,   # (grid,) int64 candidates per block              writes 8n/BLOCK
    partial_ptr,  # (S,) int64 candidates in a segment's first block before it
    val_ptr,      # (C + 1,) candidate values: zeroed               writes C + 1
    idx_ptr,      # (C + 1,) int64 candidate indices: zeroed        writes 8(C + 1)
    zero_ptr,     # (nzero,) int32 zeroed (the radix select's histograms)
    n, C, nzero,
    BLOCK_: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    _, seg, hit = _seg_hits(x_ptr, thr_ptr, seg_ptr, offs, mask)
    h = hit.to(tl.int64)
    tl.store(counts_ptr + pid, tl.sum(h, axis=0))
    prev = tl.load(seg_ptr + offs - 1, mask=mask & (offs > 0), other=-1)
    tl.store(partial_ptr + seg, tl.cumsum(h, axis=0) - h, mask=mask & (seg != prev))
    tl.store(val_ptr + offs, tl.zeros([BLOCK_], val_ptr.dtype.element_ty), mask=offs <= C)
    tl.store(idx_ptr + offs, tl.zeros([BLOCK_], tl.int64), mask=offs <= C)
    tl.store(zero_ptr + offs, tl.zeros([BLOCK_], tl.int32), mask=offs < nzero)


@triton.jit
def _seg_compact_kernel(
    x_ptr, thr_ptr, seg_ptr,
    start_ptr,      # (nblocks,) int64 candidates before each block
    partial_ptr,    # (S,) int64 candidates in a segment's first block before it
    first_ptr,      # (S,) int64 first element of each segment
    slot_base_ptr,  # (S,) int64 first slot of each segment
    slot_end_ptr,   # (S,) int64 end of its slots
    val_ptr,        # (C + 1,) candidate values, in x's dtype     writes <= C
    idx_ptr,        # (C + 1,) int64 candidate indices             writes <= C
    n,
    BLOCK_: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    xv, seg, hit = _seg_hits(x_ptr, thr_ptr, seg_ptr, offs, mask)
    cand = tl.load(start_ptr + pid) + tl.cumsum(hit.to(tl.int64), axis=0)  # inclusive
    first = tl.load(first_ptr + seg, mask=mask, other=0)
    before = tl.load(start_ptr + first // BLOCK_, mask=mask, other=0) \
        + tl.load(partial_ptr + seg, mask=mask, other=0)  # candidates before the segment
    slot = cand - 1 - before + tl.load(slot_base_ptr + seg, mask=mask, other=0)
    keep = hit & (slot < tl.load(slot_end_ptr + seg, mask=mask, other=0))
    tl.store(val_ptr + slot, xv, mask=keep)
    tl.store(idx_ptr + slot, offs, mask=keep)


def _candidates(x, thr, seg_of, seg_start, slot_base, slot_end, slots, zero=None):
    """segment_candidates, its count zeroing ``zero`` (int32) too."""
    c.check_flat(x)
    n = x.numel()
    val = c.alloc((slots + 1,), x.dtype, x.device)
    idx = c.alloc((slots + 1,), torch.int64, x.device)
    if n == 0 or slots == 0:
        if zero is not None:
            zero.zero_()
        return val.zero_(), idx.zero_()
    nzero = 0 if zero is None else zero.numel()
    nblocks = triton.cdiv(n, c.BLOCK)
    # the blocks of x, of the slots, of what is zeroed
    grid = max(nblocks, triton.cdiv(slots + 1, c.BLOCK), triton.cdiv(nzero, c.BLOCK))
    counts = torch.empty(grid, dtype=torch.int64, device=x.device)
    partial = torch.empty(seg_start.numel(), dtype=torch.int64, device=x.device)
    _seg_count_kernel[(grid,)](x, thr, seg_of, counts, partial, val, idx,
                               counts if zero is None else zero, n, slots, nzero,
                               BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    start = _excl_scan(counts)
    _seg_compact_kernel[(nblocks,)](x, thr, seg_of, start, partial, seg_start, slot_base,
                                    slot_end, val, idx, n, BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    return val, idx


def segment_candidates(x: torch.Tensor, thr: torch.Tensor, seg_of: torch.Tensor,
                       seg_start: torch.Tensor, slot_base: torch.Tensor, slot_end: torch.Tensor,
                       slots: int):
    """(values (C + 1,) in x's dtype, int64 indices (C + 1,)): for each segment s, the first
    slot_end[s] - slot_base[s] elements of x with |x| >= thr[s] (NaN: none), in index order,
    at slots slot_base[s]...; the others hold 0 (slot C, the torch path's spill slot, too).
    The slots of :func:`gradcomp.kernels.segmented.select_above`'s "cumsum" way. Three
    launches."""
    return _candidates(x, thr, seg_of, seg_start, slot_base, slot_end, slots)


# ------------------------------------------------- segmented radix select (segment_kth)
# kernels/segmented.py's kth_largest in one launch per pass and one more (11, 11, 9 bits):
# each pass a histogram of each entity's digit among its elements that match the digits
# found so far (one block-local tl.histogram for the block's first entity, atomics for the
# elements of any other); a program finds the digits found so far of the entities in its
# block itself, from the earlier passes' histograms; then one program per entity finds all
# its digits. An entity that needs none ends with t = 0x7FFFFFFF (every digit the largest)
# and r = 0: segment_take keeps none of its slots.
@triton.jit
def _kth_digits(
    hist_ptr,   # (passes, E * STRIDE) int32 the passes' histograms
    pass_ptr,   # (passes, 2) int32 each pass's (shift, width)
    need_ptr,   # (E,) how many each entity needs
    e,          # the entity
    npass,      # the passes to read (the first ones)
    EBINS,      # E * STRIDE
    STRIDE: tl.constexpr,
):
    """(the digits found in the first ``npass`` passes, what is still needed after them)."""
    bins = tl.arange(0, STRIDE)
    need = tl.load(need_ptr + e).to(tl.int32)
    pre = tl.zeros([], tl.int32)
    for j in range(0, npass):
        width = tl.load(pass_ptr + 2 * j + 1)
        real = bins < (1 << width)
        h = tl.load(hist_ptr + j * EBINS + e * STRIDE + bins, mask=real, other=0)
        desc = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # this digit or a larger one
        d = tl.maximum(tl.sum(((desc >= need) & real).to(tl.int32), axis=0) - 1, 0)
        need -= tl.sum(tl.where(bins > d, h, 0), axis=0)
        pre = (pre << width) + d
    return pre, need


@triton.jit
def _kth_block(hist_ptr, pass_ptr, need_ptr, e, mask, npass, EBINS, STRIDE: tl.constexpr,
               BLOCK_: tl.constexpr):
    """:func:`_kth_digits` of each element's entity e (int64, < EBINS), per element of a
    block: one search per entity from the block's least to its greatest (a run of them, for
    entities in runs)."""
    pre = tl.zeros([BLOCK_], tl.int32)
    left = tl.zeros([BLOCK_], tl.int32)
    lo = tl.min(tl.where(mask, e, EBINS), axis=0)
    hi = tl.max(tl.where(mask, e, -1), axis=0)
    for q in range(lo, hi + 1):
        pq, lq = _kth_digits(hist_ptr, pass_ptr, need_ptr, q, npass, EBINS, STRIDE)
        pre = tl.where(e == q, pq, pre)
        left = tl.where(e == q, lq, left)
    return pre, left


@triton.jit
def _kth_hist_kernel(
    val_ptr,     # (L,) fp32: ranked by |val|                  reads 4L
    ent_ptr,     # (L,) int64 entity of each element          reads 8L
    need_ptr,    # (E,) how many each entity needs
    pass_ptr,    # (passes, 2) int32 each pass's (shift, width)
    hist_ptr,    # (passes, E * STRIDE) int32 histograms, zeroed: this pass's is added to
    L, EBINS,
    PASS: tl.constexpr,
    SHIFT: tl.constexpr,
    WIDTH: tl.constexpr,
    STRIDE: tl.constexpr,
    BLOCK_: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < L
    b = tl.abs(tl.load(val_ptr + offs, mask=mask, other=0.0)).to(tl.int32, bitcast=True)
    e = tl.load(ent_ptr + offs, mask=mask, other=0)
    digit = (b >> SHIFT) & ((1 << WIDTH) - 1)
    if PASS > 0:  # only the elements that match the digits found so far
        pre, _ = _kth_block(hist_ptr, pass_ptr, need_ptr, e, mask, PASS, EBINS, STRIDE, BLOCK_)
        mask = mask & ((b >> (SHIFT + WIDTH)) == pre)
    hist_ptr += PASS * EBINS
    e0 = tl.load(ent_ptr + pid.to(tl.int64) * BLOCK_)
    mine = mask & (e == e0)
    # the others' digits go to the upper half of the bins, which is not counted
    local = tl.histogram(tl.where(mine, digit, digit + (1 << WIDTH)), 2 << WIDTH)
    bins = tl.arange(0, 2 << WIDTH)
    tl.atomic_add(hist_ptr + e0 * STRIDE + bins, local, mask=(bins < (1 << WIDTH)) & (local > 0))
    tl.atomic_add(hist_ptr + e * STRIDE + digit, tl.full([BLOCK_], 1, tl.int32),
                  mask=mask & (e != e0))


@triton.jit
def _kth_final_kernel(
    hist_ptr, pass_ptr, need_ptr,
    prefix_ptr,  # (E,) int32 out: each entity's digits (AT: unused)
    left_ptr,    # (E,) int32 out: what is left after them (AT: unused)
    at_ptr,      # AT: (S,) int64 an entity per output, or E (NaN), or above (0)
    out_ptr,     # AT: (S,) fp32 out: the magnitude of that entity's digits, NaN or 0
    E, npass, EBINS,
    STRIDE: tl.constexpr,
    AT: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    if AT:
        at = tl.load(at_ptr + s)
        pre, _ = _kth_digits(hist_ptr, pass_ptr, need_ptr, tl.minimum(at, E - 1), npass, EBINS,
                             STRIDE)
        # NaN is torch's (0x7FC00000): the bits of torch.cat([t, (nan, 0)])[at]
        got = tl.where(at < E, pre, tl.where(at == E, 0x7FC00000, 0))
        tl.store(out_ptr + s, got.to(tl.float32, bitcast=True))
    else:
        pre, left = _kth_digits(hist_ptr, pass_ptr, need_ptr, s, npass, EBINS, STRIDE)
        tl.store(prefix_ptr + s, pre)
        tl.store(left_ptr + s, left)


@functools.lru_cache(maxsize=8)
def _pass_table(passes, device) -> torch.Tensor:
    return torch.tensor(passes, dtype=torch.int32, device=device)


def _stride(passes) -> int:
    return 1 << max(w for _, w in passes)


def _kth_hist(mag, ent, need, E, passes, hist=None):
    """The radix passes' histograms (passes, E * stride) (into ``hist``, zeroed, if given),
    the table of passes and the stride."""
    stride = _stride(passes)
    L, dev = mag.numel(), mag.device
    table = _pass_table(tuple(passes), dev)
    if hist is None:
        hist = torch.zeros(len(passes), E * stride, dtype=torch.int32, device=dev)
    nblocks = triton.cdiv(L, c.BLOCK)
    if nblocks:
        for i, (shift, width) in enumerate(passes):
            _kth_hist_kernel[(nblocks,)](mag, ent, need, table, hist, L, E * stride, PASS=i,
                                         SHIFT=shift, WIDTH=width, STRIDE=stride,
                                         BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    return hist, table, stride


def segment_kth(mag: torch.Tensor, ent: torch.Tensor, need: torch.Tensor, E: int, passes):
    """(t (E,), r (E,)) int32: :func:`gradcomp.kernels.segmented.kth_largest` of |mag| (fp32,
    ent (L,) int64, need (E,)) with its radix ``passes`` ((shift, width) pairs, checked by
    ``segmented.check_passes``): a zero fill, 1 launch per pass and 1 more, no host read."""
    c.check_flat(mag)
    dev = mag.device
    prefix = torch.empty(E, dtype=torch.int32, device=dev)
    left = torch.empty(E, dtype=torch.int32, device=dev)
    if E == 0:
        return prefix, left
    hist, table, stride = _kth_hist(mag, ent, need, E, passes)
    _kth_final_kernel[(E,)](hist, table, need, prefix, left, prefix, prefix, E, len(passes),
                            E * stride, STRIDE=stride, AT=False)
    return prefix, left


def segment_kth_at(mag: torch.Tensor, ent: torch.Tensor, need: torch.Tensor, E: int, passes,
                   at: torch.Tensor, hist: torch.Tensor | None = None) -> torch.Tensor:
    """(S,) fp32: ``torch.cat([t.view(torch.float32), (NaN, 0)])[at]`` for t of
    :func:`segment_kth` (at (S,) int64 in [0, E + 1]): the magnitudes found, gathered in
    the last launch. ``hist``: the histograms' buffer, zeroed (else a zero fill)."""
    c.check_flat(mag)
    out = c.alloc((at.numel(),), torch.float32, mag.device)
    if at.numel() == 0:
        return out
    if E == 0:  # no entity: NaN or 0
        return out.copy_(torch.where(at == 0, float("nan"), 0.0))
    hist, table, stride = _kth_hist(mag, ent, need, E, passes, hist)
    _kth_final_kernel[(at.numel(),)](hist, table, need, out, out, at, out, E, len(passes),
                                     E * stride, STRIDE=stride, AT=True)
    return out


@triton.jit
def _sample_kernel(
    x_ptr,       # (n,) the bucket                              reads 4M (gathered)
    base_ptr,    # (M,) int64 each sample's Weyl point
    of_ptr,      # (M,) int64 its parameter
    shift_ptr,   # (P,) int64 each parameter's shift this step
    n_ptr,       # (M,) int64 its parameter's element count
    off_ptr,     # (M,) int64 its parameter's offset
    out_ptr,     # (M,) fp32 the sampled values                 writes 4M
    zero_ptr,    # (nzero,) int32 zeroed (the radix select's histograms)
    M, nzero,
    BLOCK_: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < M
    at = tl.load(base_ptr + offs, mask=mask, other=0) \
        + tl.load(shift_ptr + tl.load(of_ptr + offs, mask=mask, other=0), mask=mask, other=0)
    at = at % tl.load(n_ptr + offs, mask=mask, other=1) \
        + tl.load(off_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, tl.load(x_ptr + at, mask=mask, other=0.0), mask=mask)
    tl.store(zero_ptr + offs, tl.zeros([BLOCK_], tl.int32), mask=offs < nzero)


def _sample(x, base, of, shifts, n, off, zero=None):
    """segment_sample, the launch zeroing ``zero`` (int32) too."""
    c.check_flat(x)
    M = base.numel()
    out = c.alloc((M,), x.dtype, x.device)
    nzero = 0 if zero is None else zero.numel()
    grid = max(triton.cdiv(M, c.BLOCK), triton.cdiv(nzero, c.BLOCK))
    if grid:
        _sample_kernel[(grid,)](x, base, of, shifts, n, off, out,
                                out if zero is None else zero, M, nzero,
                                BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    return out


def segment_sample(x: torch.Tensor, base: torch.Tensor, of: torch.Tensor, shifts: torch.Tensor,
                   n: torch.Tensor, off: torch.Tensor):
    """(M,) x at (base + shifts[of]) % n + off: :func:`gradcomp.kernels.segmented.sample`'s
    positions, gathered in one launch."""
    return _sample(x, base, of, shifts, n, off)


def segment_thresholds(x: torch.Tensor, base: torch.Tensor, of: torch.Tensor,
                       shifts: torch.Tensor, n: torch.Tensor, off: torch.Tensor,
                       need: torch.Tensor, E: int, passes, at: torch.Tensor) -> torch.Tensor:
    """(S,) fp32: :func:`segment_kth_at` of :func:`segment_sample`'s values (their entities
    ``of``), the histograms zeroed by the sample's launch: 1 launch, 1 per pass and 1 more
    (:func:`gradcomp.kernels.segmented.thresholds`' Triton way)."""
    if E == 0 or base.numel() == 0:
        return segment_kth_at(segment_sample(x, base, of, shifts, n, off), of, need, E, passes,
                              at)
    hist = torch.empty(len(passes), E * _stride(passes), dtype=torch.int32, device=x.device)
    s = _sample(x, base, of, shifts, n, off, zero=hist)
    return segment_kth_at(s, of, need, E, passes, at, hist=hist)


@triton.jit
def _take_rank(t_ptr, r_ptr, hist_ptr, pass_ptr, need_ptr, p, mask, npass, EBINS,
               STRIDE: tl.constexpr, BLOCK_: tl.constexpr, HIST: tl.constexpr):
    """(t, r) of each slot's parameter p: loaded, or (HIST) found in the radix select's
    histograms."""
    if HIST:
        t, r = _kth_block(hist_ptr, pass_ptr, need_ptr, p, mask, npass, EBINS, STRIDE, BLOCK_)
    else:
        t = tl.load(t_ptr + p, mask=mask, other=0)
        r = tl.load(r_ptr + p, mask=mask, other=0)
    return t, r


@triton.jit
def _take_serial_kernel(
    val_ptr,        # (C + 1,) candidate values, fp32                reads 4C
    idx_ptr,        # (C + 1,) int64 candidate indices                reads <= 8K
    t_ptr,          # (P,) int32 each parameter's k_p-th largest magnitude's bits
    r_ptr,          # (P,) int32 how many of its k_p largest equal it
    first_ptr,      # (P + 1,) int64 first slot of each parameter; then C
    place_ptr,      # (P,) int64 first output place of each parameter
    out_val_ptr,    # (K,) values                                    writes 4K
    out_idx_ptr,    # (K,) int64 indices                             writes 8K
    hist_ptr, pass_ptr, need_ptr,  # HIST: t and r from the radix select's histograms
    npass, EBINS,
    STRIDE: tl.constexpr,
    HIST: tl.constexpr,
    BLOCK_: tl.constexpr,
):
    p = tl.program_id(0)
    lo = tl.load(first_ptr + p)
    hi = tl.load(first_ptr + p + 1)
    if HIST:
        t, r = _kth_digits(hist_ptr, pass_ptr, need_ptr, p, npass, EBINS, STRIDE)
    else:
        t = tl.load(t_ptr + p)
        r = tl.load(r_ptr + p)
    place = tl.load(place_ptr + p)
    ties = 0
    for start in range(lo, hi, BLOCK_):  # the parameter's slots, in order
        offs = start + tl.arange(0, BLOCK_)
        mask = offs < hi
        v = tl.load(val_ptr + offs, mask=mask, other=0.0)
        b = tl.abs(v).to(tl.int32, bitcast=True)
        eq = mask & (b == t)
        rank = ties + tl.cumsum(eq.to(tl.int32), axis=0) - 1  # ties in earlier slots
        keep = mask & ((b > t) | (eq & (rank < r)))
        at = place + tl.cumsum(keep.to(tl.int64), axis=0) - 1
        tl.store(out_val_ptr + at, v, mask=keep)
        tl.store(out_idx_ptr + at, tl.load(idx_ptr + offs, mask=keep, other=0), mask=keep)
        ties += tl.sum(eq.to(tl.int32), axis=0)
        place += tl.sum(keep.to(tl.int64), axis=0)


@triton.jit
def _take_packed(val_ptr, t, offs, mask):
    """Per slot: (above << 32) | equal, against its parameter's t; the bits of |val|."""
    b = tl.abs(tl.load(val_ptr + offs, mask=mask, other=0.0)).to(tl.int32, bitcast=True)
    packed = ((b > t).to(tl.int64) << 32) | (b == t).to(tl.int64)
    return tl.where(mask, packed, 0), b


@triton.jit
def _take_count_kernel(
    val_ptr, par_ptr, t_ptr, r_ptr,
    counts_ptr,   # (nblocks,) int64 packed counts per block
    partial_ptr,  # (P,) int64 packed counts in a parameter's first block before its slots
    hist_ptr, pass_ptr, need_ptr, npass, EBINS,
    C,
    STRIDE: tl.constexpr,
    HIST: tl.constexpr,
    BLOCK_: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < C
    p = tl.load(par_ptr + offs, mask=mask, other=0)
    t, _ = _take_rank(t_ptr, r_ptr, hist_ptr, pass_ptr, need_ptr, p, mask, npass, EBINS,
                      STRIDE, BLOCK_, HIST)
    packed, _ = _take_packed(val_ptr, t, offs, mask)
    tl.store(counts_ptr + tl.program_id(0), tl.sum(packed, axis=0))
    prev = tl.load(par_ptr + offs - 1, mask=mask & (offs > 0), other=-1)
    tl.store(partial_ptr + p, tl.cumsum(packed, axis=0) - packed, mask=mask & (p != prev))


@triton.jit
def _take_place_kernel(
    val_ptr, idx_ptr, par_ptr, t_ptr, r_ptr,
    start_ptr,      # (nblocks,) int64 packed counts before each block
    partial_ptr,    # (P,) int64 packed counts in a parameter's first block before its slots
    first_ptr,      # (P + 1,) int64 first slot of each parameter
    place_ptr,      # (P,) int64 first output place of each parameter
    out_val_ptr, out_idx_ptr,
    hist_ptr, pass_ptr, need_ptr, npass, EBINS,
    C,
    STRIDE: tl.constexpr,
    HIST: tl.constexpr,
    BLOCK_: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < C
    p = tl.load(par_ptr + offs, mask=mask, other=0)
    t, r = _take_rank(t_ptr, r_ptr, hist_ptr, pass_ptr, need_ptr, p, mask, npass, EBINS,
                      STRIDE, BLOCK_, HIST)
    packed, b = _take_packed(val_ptr, t, offs, mask)
    # inclusive counts within the parameter, then those of the slots before this one
    first = tl.load(first_ptr + p, mask=mask, other=0)
    incl = tl.load(start_ptr + pid) + tl.cumsum(packed, axis=0) \
        - tl.load(start_ptr + first // BLOCK_, mask=mask, other=0) \
        - tl.load(partial_ptr + p, mask=mask, other=0)
    gt, eq = b > t, b == t
    above = (incl >> 32) - gt.to(tl.int64)
    ties = (incl & 0xFFFFFFFF) - eq.to(tl.int64)
    r = r.to(tl.int64)
    keep = mask & (gt | (eq & (ties < r)))
    at = tl.load(place_ptr + p, mask=mask, other=0) + above + tl.minimum(ties, r)
    tl.store(out_val_ptr + at, tl.load(val_ptr + offs, mask=keep, other=0.0), mask=keep)
    tl.store(out_idx_ptr + at, tl.load(idx_ptr + offs, mask=keep, other=0), mask=keep)


# A parameter of more slots than this many blocks: segment_take goes over all slots in
# parallel (3 launches) instead of one program walking each parameter's slots (1 launch)
SERIAL_BLOCKS = 16


def _take(val, idx, t, r, first, place, K, slot_param, widest, kth=None):
    """segment_take; ``kth`` (histograms, table of passes, need, stride): t and r found in
    the radix select's histograms by the take's own launches."""
    c.check_flat(val)
    out_val = c.alloc((K,), val.dtype, val.device)
    out_idx = c.alloc((K,), torch.int64, val.device)
    P, C = place.numel(), slot_param.numel()
    if not (P and K):
        return out_val, out_idx
    if kth is None:
        hist, table, need, npass, stride = t, t, t, 0, 1
    else:
        hist, table, need, stride = kth
        npass = table.shape[0]
    rank = dict(npass=npass, EBINS=P * stride, STRIDE=stride, HIST=kth is not None,
                BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    if widest <= SERIAL_BLOCKS * c.BLOCK:
        _take_serial_kernel[(P,)](val, idx, t, r, first, place, out_val, out_idx, hist, table,
                                  need, **rank)
        return out_val, out_idx
    nblocks = triton.cdiv(C, c.BLOCK)
    counts = torch.empty(nblocks, dtype=torch.int64, device=val.device)
    partial = torch.empty(P, dtype=torch.int64, device=val.device)
    _take_count_kernel[(nblocks,)](val, slot_param, t, r, counts, partial, hist, table, need,
                                   C=C, **rank)
    start = _excl_scan(counts)
    _take_place_kernel[(nblocks,)](val, idx, slot_param, t, r, start, partial, first, place,
                                   out_val, out_idx, hist, table, need, C=C, **rank)
    return out_val, out_idx


def segment_take(val: torch.Tensor, idx: torch.Tensor, t: torch.Tensor, r: torch.Tensor,
                 first: torch.Tensor, place: torch.Tensor, K: int, slot_param: torch.Tensor,
                 widest: int):
    """(values (K,), int64 indices (K,)): for each parameter p, its slots
    [first[p], first[p + 1]) of val (fp32) / idx whose magnitude's bits are above t[p], and
    the first r[p] equal to it, in slot order, at [place[p], ...): what
    :func:`gradcomp.kernels.segmented._take_largest` keeps. slot_param (C,): each slot's
    parameter; widest: the most slots of one parameter. One program per parameter walking
    its slots (1 launch) where no parameter has more than SERIAL_BLOCKS blocks of them; else
    3 launches over all slots at once: a count per block (and each parameter's count in its
    first block before it), one program's exclusive scan of the tiny counts, a placement."""
    return _take(val, idx, t, r, first, place, K, slot_param, widest)


def segment_select(x: torch.Tensor, thr: torch.Tensor, seg_of: torch.Tensor,
                   seg_start: torch.Tensor, slot_base: torch.Tensor, slot_end: torch.Tensor,
                   need: torch.Tensor, first: torch.Tensor, place: torch.Tensor, K: int,
                   slot_param: torch.Tensor, widest: int, passes):
    """(values (K,), int64 indices (K,)): :func:`segment_take` of :func:`segment_candidates`'
    slots (C = slot_param's length) with :func:`segment_kth`'s t and r of them (entity: the
    slot's parameter, need (P,)), in fewer launches: the candidates' count zeroes the radix
    select's histograms, and the take finds t and r in them itself. 3 + 1 per pass + 1 (or
    3) launches (:func:`gradcomp.kernels.segmented._take_largest`'s Triton way)."""
    P, C = place.numel(), slot_param.numel()
    stride = _stride(passes)
    hist = torch.empty(len(passes), P * stride, dtype=torch.int32, device=x.device)
    val, idx = _candidates(x, thr, seg_of, seg_start, slot_base, slot_end, C, zero=hist)
    if P == 0 or C == 0:
        return _take(val, idx, hist, hist, first, place, K, slot_param, widest)
    mag = val[:C]  # the spill slot C is never taken
    hist, table, stride = _kth_hist(mag, slot_param, need, P, passes, hist=hist)
    return _take(val, idx, hist, hist, first, place, K, slot_param, widest,
                 kth=(hist, table, need, stride))
