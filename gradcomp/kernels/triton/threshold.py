"""Threshold quantization's Triton kernels (compressors/threshold.py): threshold_sample,
threshold_tau, threshold_encode, threshold_decode, as kernels/reference.py specifies them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common as c


# --------------------------------------------------------------------------- threshold quantization
@triton.jit
def _threshold_sample_kernel(
    x_ptr,      # (n,) fp32 the bucket
    e_ptr,      # (n,) fp32 the residual (HAS_E)
    y_ptr,      # (n,) fp32 out: y = x + e (HAS_E)
    base_ptr,   # (M,) int64 each sample's Weyl point
    of_ptr,     # (M,) int64 its parameter
    shift_ptr,  # (P,) int64 each parameter's shift
    n_ptr,      # (M,) int64 its parameter's size
    off_ptr,    # (M,) int64 its parameter's offset
    key_ptr,    # (M + 2,) int64 sort base of each sample
    tail_ptr,   # (2,) fp32 the constants closing the sample
    keys_ptr,   # (M + 2,) int64 out
    mag_ptr,    # (M + 2,) fp32 out
    N, M, NB,
    HAS_E: tl.constexpr, BLOCK_: tl.constexpr,
):
    # programs [0, NB): y over the bucket; the others: the sample, whose elements of y they
    # add themselves (the same bits)
    pid = tl.program_id(0)
    if pid < NB:
        i = pid.to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
        m = i < N
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m, other=0.0) + tl.load(e_ptr + i, mask=m,
                                                                              other=0.0), mask=m)
    else:
        j = (pid - NB).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
        mask = j < M + 2
        ins = j < M
        b = tl.load(base_ptr + j, mask=ins, other=0)
        sh = tl.load(shift_ptr + tl.load(of_ptr + j, mask=ins, other=0), mask=ins, other=0)
        at = (b + sh) % tl.load(n_ptr + j, mask=ins, other=1) + tl.load(off_ptr + j, mask=ins,
                                                                        other=0)
        v = tl.load(x_ptr + at, mask=ins, other=0.0).to(tl.float32)
        if HAS_E:
            v = v + tl.load(e_ptr + at, mask=ins, other=0.0)
        t = tl.load(tail_ptr + (j - M), mask=mask & ~ins, other=0.0)
        mag = tl.where(ins, tl.abs(v), t)
        key = tl.load(key_ptr + j, mask=mask, other=0) - mag.to(tl.int32, bitcast=True).to(tl.int64)
        tl.store(keys_ptr + j, key, mask=mask)
        tl.store(mag_ptr + j, mag, mask=mask)


def threshold_sample(x, e, y, base, of, shifts, n, off, key, tail):
    """See :func:`gradcomp.kernels.reference.threshold_sample`: one launch (two where y is
    e itself: the sample reads e before y = x + e is written over it)."""
    L, N = key.numel(), x.numel()
    keys = c.alloc((L,), torch.int64, x.device)
    mag = c.alloc((L,), torch.float32, x.device)
    over = e is not None and y.data_ptr() == e.data_ptr()
    nb = triton.cdiv(N, c.BLOCK) if e is not None and not over else 0
    _threshold_sample_kernel[(nb + triton.cdiv(L, c.BLOCK),)](
        x, e if e is not None else x, y if e is not None else x, base, of, shifts, n, off, key,
        tail, keys, mag, N, L - 2, nb, HAS_E=e is not None, BLOCK_=c.BLOCK,
        num_warps=c.NUM_WARPS)
    if over:
        torch.add(x, e, out=y)
    return keys, mag


@triton.jit
def _threshold_tau_kernel(
    keys_ptr,       # (L,) int64 sorted sample keys
    order_ptr,      # (L,) int64 the sort's permutation
    mag_ptr,        # (L,) fp32 sample magnitudes, unsorted (sorted: mag[order])
    zero_key_ptr,   # (P,) int64 the key of each parameter's 0 magnitude
    est_start_ptr, est_end_ptr,  # (P,) int64
    taus_ptr,       # (all,) fp32 tau memory, in place at where (if ADAPTIVE)
    where_ptr,      # (P,) int64
    seg_thr_ptr,    # (S,) int64 each segment's threshold's place in the sorted sample
    seg_param_ptr,  # (S,) int64
    param_seg_ptr,  # (P,) int64
    sent_ptr,       # (P,) fp32 out
    thr_ptr,        # (S,) fp32 out
    S, P, L, iters, fixed, w,
    ADAPTIVE: tl.constexpr, BLOCK_: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    smask = s < S
    g = tl.load(mag_ptr + tl.load(order_ptr + tl.load(seg_thr_ptr + s, mask=smask, other=0),
                                  mask=smask, other=0), mask=smask, other=0.0)
    p = tl.load(seg_param_ptr + s, mask=smask, other=0)
    mask = smask & (p < P)
    mask = mask & (tl.load(param_seg_ptr + p, mask=mask, other=-1) == s)  # p's own segment
    if ADAPTIVE:
        # searchsorted (left) of the parameter's zero key: the end of its non-zero samples
        zk = tl.load(zero_key_ptr + p, mask=mask, other=0)
        lo = tl.zeros((BLOCK_,), tl.int64)
        hi = lo + L
        for _ in range(iters):
            active = lo < hi
            mid = (lo + hi) // 2
            below = tl.load(keys_ptr + mid, mask=mask & active, other=0) < zk
            lo = tl.where(active & below, mid + 1, lo)
            hi = tl.where(active & ~below, mid, hi)
        nz = lo
        es = tl.load(est_start_ptr + p, mask=mask, other=0)
        ee = tl.load(est_end_ptr + p, mask=mask, other=1)
        none = nz <= es
        at_est = tl.load(order_ptr + tl.minimum(ee, nz) - 1, mask=mask & ~none, other=0)
        est = tl.load(mag_ptr + at_est, mask=mask & ~none, other=0.0)
        est = tl.where(none, float("inf"), est)
        at = tl.load(where_ptr + p, mask=mask, other=0)
        prev = tl.load(taus_ptr + at, mask=mask, other=0.0)
        end = tl.where(est == float("inf"), prev, est)  # (an inf est keeps prev, below)
        diff = end - prev
        if w < 0.5:  # torch.lerp's two forms (the same rounding as the reference)
            mixed = prev + w * diff
        else:
            mixed = end - diff * (1 - w)
        tau = tl.where(prev == 0, est, tl.where(est == float("inf"), prev, mixed))
    else:
        tau = tl.zeros((BLOCK_,), tl.float32) + fixed
    isinf = tau == float("inf")
    sent = tl.where(isinf, 0.0, tau)
    if ADAPTIVE:
        tl.store(taus_ptr + at, sent, mask=mask)
    tl.store(sent_ptr + p, sent, mask=mask)
    # nextafter(tau, +inf) of a non-negative tau: the next bit pattern (+inf stays)
    nxt = tl.where(isinf, tau, (tau.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True))
    tl.store(thr_ptr + s, tl.where(mask, tl.maximum(g, nxt), g), mask=smask)


def threshold_tau(keys, order, mag, zero_key, est_start, est_end, taus, where, seg_thr,
                  seg_param, param_seg, fixed, ema, out=None):
    """See :func:`gradcomp.kernels.reference.threshold_tau`: one launch, one lane per
    segment (a parameter's lane is its segment's). Taus are non-negative (magnitudes, or a
    fixed tau > 0)."""
    P, S, L = est_start.numel(), seg_thr.numel(), keys.numel()
    sent = c.alloc((P,), torch.float32, mag.device) if out is None else out
    thr = c.alloc((S,), torch.float32, mag.device)
    if S:
        adaptive = taus is not None
        _threshold_tau_kernel[(triton.cdiv(S, 1024),)](
            keys, order, mag, zero_key, est_start, est_end, taus if adaptive else sent, where,
            seg_thr, seg_param, param_seg, sent, thr, S, P, L, L.bit_length() + 1,
            float(fixed or 0.0), float(1 - ema), ADAPTIVE=adaptive, BLOCK_=1024,
            num_warps=c.NUM_WARPS)
    return sent, thr


@triton.jit
def _threshold_encode_kernel(
    val_ptr,    # (K,) selected values (0: unused slot)
    idx_ptr,    # (K,) int64 their indices
    owner_ptr,  # (K,) int64 parameter of each slot
    tau_ptr,    # (P,) fp32
    res_ptr,    # (n,) fp32 residual (what vals came from), in place at sent indices (HAS_RES)
    x_ptr,      # (n,) fp32 the bucket: the dense values' source
    dense_ptr,  # (D,) int64 the dense values' positions
    word_ptr,   # (K + P + D,) int32 out: the message (codes, taus, dense values' bits)
    K, P, D,
    HAS_RES: tl.constexpr, BLOCK_: tl.constexpr,
):
    # lanes [0, K): one code slot each; [K, K + D): one dense value each
    k = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = k < K
    v = tl.load(val_ptr + k, mask=mask, other=0.0).to(tl.float32)
    i = tl.load(idx_ptr + k, mask=mask, other=0)
    sgn = tl.where(v > 0, 1, tl.where(v < 0, -1, 0))
    tl.store(word_ptr + k, (i + 1).to(tl.int32) * sgn, mask=mask)
    if HAS_RES:  # a sent element's index is its own (unused slots add nothing)
        t = tl.load(tau_ptr + tl.load(owner_ptr + k, mask=mask, other=0), mask=mask, other=0.0)
        r = tl.load(res_ptr + i, mask=mask & (sgn != 0), other=0.0)
        tl.store(res_ptr + i, r - sgn.to(tl.float32) * t, mask=mask & (sgn != 0))
    dm = (k >= K) & (k < K + D)
    at = tl.load(dense_ptr + (k - K), mask=dm, other=0)
    d = tl.load(x_ptr + at, mask=dm, other=0.0).to(tl.float32)
    tl.store(word_ptr + P + k, d.to(tl.int32, bitcast=True), mask=dm)
    if HAS_RES:
        tl.store(res_ptr + at, tl.zeros((BLOCK_,), tl.float32), mask=dm)


def threshold_encode(vals, idx, owner, tau, residual, x, dense, words):
    """See :func:`gradcomp.kernels.reference.threshold_encode`: one launch."""
    c.check_contiguous(words, "words")
    K, P, D = vals.numel(), tau.numel(), dense.numel()
    if K + D:
        _threshold_encode_kernel[(triton.cdiv(K + D, c.BLOCK),)](
            vals, idx, owner, tau, residual if residual is not None else x, x, dense, words,
            K, P, D, HAS_RES=residual is not None, BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    return words[:K]


@triton.jit
def _threshold_decode_kernel(
    got_ptr,    # (W, row) int32 messages: K codes, P taus (fp32 bits), D dense values (bits)
    owner_ptr,  # (K,) int64
    dense_ptr,  # (D,) int64 the dense values' positions
    out_ptr,    # (n,) fp32 accumulator (atomic adds; the dense positions written)
    row, K, P, D, W,
    BLOCK_: tl.constexpr,
):
    # lanes [0, K): one code slot each; [K, K + D): one dense value each
    k = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = k < K
    o = tl.load(owner_ptr + k, mask=mask, other=0)
    base = got_ptr  # row w's: advanced (no int32 product w * row)
    for w in range(W):
        c = tl.load(base + k, mask=mask, other=0)
        t = tl.load(base + K + o, mask=mask, other=0).to(tl.float32, bitcast=True)
        on = mask & (c != 0)
        v = tl.where(c > 0, t, -t)
        tl.atomic_add(out_ptr + tl.abs(c).to(tl.int64) - 1, v, mask=on, sem="relaxed")
        base += row
    dm = (k >= K) & (k < K + D)
    dp = got_ptr + P
    total = tl.load(dp + k, mask=dm, other=0).to(tl.float32, bitcast=True)
    for w in range(1, W):  # in rank order
        dp += row
        total += tl.load(dp + k, mask=dm, other=0).to(tl.float32, bitcast=True)
    tl.store(out_ptr + tl.load(dense_ptr + (k - K), mask=dm, other=0), total, mask=dm)


def threshold_decode(got, K, P, owner, out, dense):
    """See :func:`gradcomp.kernels.reference.threshold_decode`: one launch of atomic adds
    (the order of two ranks' adds to one element may vary on a GPU, as in scatter_add) and
    the dense values' sums."""
    c.check_flat(out, "out")
    c.check_contiguous(got, "got")
    D = dense.numel()
    if (K + D) and got.shape[0]:
        _threshold_decode_kernel[(triton.cdiv(K + D, c.BLOCK),)](
            got, owner, dense, out, got.shape[1], K, P, D, got.shape[0], BLOCK_=c.BLOCK,
            num_warps=c.NUM_WARPS)
    return out
