"""Threshold quantization's Triton kernels (compressors/threshold.py): threshold_tau,
threshold_encode, threshold_decode, as kernels/reference.py specifies them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common as c


# --------------------------------------------------------------------------- threshold quantization
@triton.jit
def _threshold_tau_kernel(
    mag_ptr,        # (M + 2,) fp32 sorted sample magnitudes
    nz_ptr,         # (P,) int64 end of each parameter's non-zero samples
    est_start_ptr, est_end_ptr,  # (P,) int64
    taus_ptr,       # (all,) fp32 tau memory, in place at where (if ADAPTIVE)
    where_ptr,      # (P,) int64
    guard_ptr,      # (S,) fp32
    param_seg_ptr,  # (P,) int64
    sent_ptr,       # (P,) fp32 out
    thr_ptr,        # (S,) fp32 out (a copy of guard: only parameters' segments written)
    P, fixed, w,
    ADAPTIVE: tl.constexpr, BLOCK_: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = p < P
    if ADAPTIVE:
        nz = tl.load(nz_ptr + p, mask=mask, other=0)
        es = tl.load(est_start_ptr + p, mask=mask, other=0)
        ee = tl.load(est_end_ptr + p, mask=mask, other=1)
        none = nz <= es
        est = tl.load(mag_ptr + tl.minimum(ee, nz) - 1, mask=mask & ~none, other=0.0)
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
    s = tl.load(param_seg_ptr + p, mask=mask, other=0)
    g = tl.load(guard_ptr + s, mask=mask, other=0.0)
    tl.store(thr_ptr + s, tl.maximum(g, nxt), mask=mask)


def threshold_tau(mag, nonzero_end, est_start, est_end, taus, where, guard, seg_param, param_seg,
                  fixed, ema):
    """See :func:`gradcomp.kernels.reference.threshold_tau`: one launch (and a copy of
    guard). Taus are non-negative (magnitudes, or a fixed tau > 0)."""
    P = est_start.numel()
    sent = c.alloc((P,), torch.float32, guard.device)
    thr = guard.clone()
    if P:
        adaptive = taus is not None
        _threshold_tau_kernel[(triton.cdiv(P, 1024),)](
            mag, nonzero_end if adaptive else est_start, est_start, est_end,
            taus if adaptive else sent, where, guard, param_seg, sent, thr, P,
            float(fixed or 0.0), float(1 - ema), ADAPTIVE=adaptive, BLOCK_=1024,
            num_warps=c.NUM_WARPS)
    return sent, thr


@triton.jit
def _threshold_encode_kernel(
    val_ptr,    # (K,) selected values (0: unused slot)
    idx_ptr,    # (K,) int64 their indices
    owner_ptr,  # (K,) int64 parameter of each slot
    tau_ptr,    # (P,) fp32
    code_ptr,   # (K,) int32 out
    res_ptr,    # (n,) fp32 residual (what vals came from), in place at sent indices (HAS_RES)
    K,
    HAS_RES: tl.constexpr, BLOCK_: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = k < K
    v = tl.load(val_ptr + k, mask=mask, other=0.0).to(tl.float32)
    i = tl.load(idx_ptr + k, mask=mask, other=0)
    sgn = tl.where(v > 0, 1, tl.where(v < 0, -1, 0))
    tl.store(code_ptr + k, (i + 1).to(tl.int32) * sgn, mask=mask)
    if HAS_RES:  # a sent element's index is its own (unused slots add nothing)
        t = tl.load(tau_ptr + tl.load(owner_ptr + k, mask=mask, other=0), mask=mask, other=0.0)
        r = tl.load(res_ptr + i, mask=mask & (sgn != 0), other=0.0)
        tl.store(res_ptr + i, r - sgn.to(tl.float32) * t, mask=mask & (sgn != 0))


def threshold_encode(vals, idx, owner, tau, residual):
    """See :func:`gradcomp.kernels.reference.threshold_encode`: one launch."""
    K = vals.numel()
    codes = c.alloc((K,), torch.int32, vals.device)
    if K:
        _threshold_encode_kernel[(triton.cdiv(K, c.BLOCK),)](
            vals, idx, owner, tau, codes, residual if residual is not None else vals, K,
            HAS_RES=residual is not None, BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    return codes


@triton.jit
def _threshold_decode_kernel(
    got_ptr,    # (W, row) int32 messages: K codes, then P taus (fp32 bits)
    owner_ptr,  # (K,) int64
    out_ptr,    # (n,) fp32 accumulator (atomic adds)
    row, K, W,
    BLOCK_: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = k < K
    o = tl.load(owner_ptr + k, mask=mask, other=0)
    for w in range(W):
        base = got_ptr + w * row
        c = tl.load(base + k, mask=mask, other=0)
        t = tl.load(base + K + o, mask=mask, other=0).to(tl.float32, bitcast=True)
        on = mask & (c != 0)
        v = tl.where(c > 0, t, -t)
        tl.atomic_add(out_ptr + tl.abs(c).to(tl.int64) - 1, v, mask=on, sem="relaxed")


def threshold_decode(got, K, P, owner, out):
    """See :func:`gradcomp.kernels.reference.threshold_decode`: one launch of atomic adds
    (the order of two ranks' adds to one element may vary on a GPU, as in scatter_add)."""
    c.check_flat(out, "out")
    c.check_contiguous(got, "got")
    if K and got.shape[0]:
        _threshold_decode_kernel[(triton.cdiv(K, c.BLOCK),)](
            got, owner, out, got.shape[1], K, got.shape[0], BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    return out
