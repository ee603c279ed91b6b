"""Top-k's and DGC's message kernels (compressors/topk.py, exchange_sparse): sparse_encode,
sparse_decode, as kernels/reference.py specifies them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common as c

_BITS = {4: torch.int32, 2: torch.int16}
_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _sparse_encode_kernel(
    wire_ptr,    # (k,) the values as they travel, as bits (int16 or int32)
    val_ptr,     # (k,) fp32 the same as they arrive (0: a padding slot)
    idx_ptr,     # (k,) int64 their places in the bucket
    res_ptr,     # (n,) fp32 error feedback's y, in place (HAS_RES)
    x_ptr,       # (n,) fp32 the bucket: the dense values' source
    dense_ptr,   # (D,) int64 the dense values' positions
    oidx_ptr,    # (k,) int32 out: the message's indices
    owire_ptr,   # (k,) out: its values (wire_ptr's type)
    odense_ptr,  # (D,) fp32 out: its dense values
    pad_ptr,     # (pad,) uint8 out: zeros before the dense values
    K, D, PAD,
    HAS_RES: tl.constexpr, BLOCK_: tl.constexpr,
):
    # lanes [0, K): one value each; [K, K + D): one dense value; then the pad bytes
    t = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = t < K
    i = tl.load(idx_ptr + t, mask=mask, other=0)
    tl.store(oidx_ptr + t, i.to(tl.int32), mask=mask)
    tl.store(owire_ptr + t, tl.load(wire_ptr + t, mask=mask, other=0), mask=mask)
    if HAS_RES:  # a sent index is its own; a padding slot (value 0) changes nothing
        v = tl.load(val_ptr + t, mask=mask, other=0.0)
        on = mask & (v != 0.0)
        tl.store(res_ptr + i, tl.load(res_ptr + i, mask=on, other=0.0) - v, mask=on)
    dm = (t >= K) & (t < K + D)
    at = tl.load(dense_ptr + (t - K), mask=dm, other=0)
    tl.store(odense_ptr + (t - K), tl.load(x_ptr + at, mask=dm, other=0.0), mask=dm)
    if HAS_RES:
        tl.store(res_ptr + at, tl.zeros((BLOCK_,), tl.float32), mask=dm)
    pm = (t >= K + D) & (t < K + D + PAD)
    tl.store(pad_ptr + (t - K - D), tl.zeros((BLOCK_,), tl.uint8), mask=pm)


def sparse_encode(wire, vals, idx, residual, x, dense, out_idx, out_wire, out_dense, pad):
    """See :func:`gradcomp.kernels.reference.sparse_encode`: one launch."""
    K, D, PAD = idx.numel(), dense.numel(), pad.numel()
    bits = _BITS[wire.element_size()]
    if K + D + PAD:
        _sparse_encode_kernel[(triton.cdiv(K + D + PAD, c.BLOCK),)](
            wire.view(bits), vals, idx, residual if residual is not None else x, x, dense,
            out_idx, out_wire.view(bits), out_dense, pad, K, D, PAD,
            HAS_RES=residual is not None, BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)


@triton.jit
def _sparse_decode_kernel(
    w32_ptr,    # (W, row) int32 the messages as words: k indices, ..., D dense values' bits
    val_ptr,    # (W, vrow) the same as values' words (int32, or int16 for 2-byte values)
    dense_ptr,  # (D,) int64 the dense values' positions
    out_ptr,    # (n,) fp32 accumulator (atomic adds; the dense positions written)
    row, vrow, vat, dat, K, D, W,
    KIND: tl.constexpr, BLOCK_: tl.constexpr,
):
    # lanes [0, K): one value slot each; [K, K + D): one dense value each
    t = tl.program_id(0).to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = t < K
    wp, vp = w32_ptr, val_ptr + vat  # row w's: pointers advanced (no int32 product w * row)
    for w in range(W):
        i = tl.load(wp + t, mask=mask, other=0)
        b = tl.load(vp + t, mask=mask, other=0)
        wp += row
        vp += vrow
        if KIND == 0:
            v = b.to(tl.float32, bitcast=True)
        elif KIND == 1:
            v = b.to(tl.float16, bitcast=True).to(tl.float32)
        else:  # bf16: the high half of an fp32
            v = (b.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        tl.atomic_add(out_ptr + i, v, mask=mask, sem="relaxed")
    dm = (t >= K) & (t < K + D)
    dp = w32_ptr + dat
    total = tl.load(dp + (t - K), mask=dm, other=0).to(tl.float32, bitcast=True)
    for w in range(1, W):  # in rank order
        dp += row
        total += tl.load(dp + (t - K), mask=dm, other=0).to(tl.float32, bitcast=True)
    tl.store(out_ptr + tl.load(dense_ptr + (t - K), mask=dm, other=0), total, mask=dm)


def sparse_decode(got, k, vals_at, dtype, dense_at, out, dense):
    """See :func:`gradcomp.kernels.reference.sparse_decode`: one launch of atomic adds (the
    order of two ranks' adds to one element may vary on a GPU, as in scatter_add) and the
    dense values' sums."""
    c.check_flat(out, "out")
    c.check_contiguous(got, "got")
    W, nbytes = got.shape
    D = dense.numel()
    size = torch.empty((), dtype=dtype).element_size()
    if (k + D) and W:
        _sparse_decode_kernel[(triton.cdiv(k + D, c.BLOCK),)](
            got.view(torch.int32), got.view(_BITS[size]), dense, out, nbytes // 4,
            nbytes // size, vals_at // size, dense_at // 4, k, D, W, KIND=_KIND[dtype],
            BLOCK_=c.BLOCK, num_warps=c.NUM_WARPS)
    return out
