"""TernGrad's Triton kernels (compressors/terngrad.py): ternary_compress and
ternary_decompress, as kernels/reference.py specifies them (see kernels/triton/__init__.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common as c
from .common import store_sum


# --------------------------------------------------------------------------- TernGrad
@triton.jit
def _ternary_compress_kernel(
    x_ptr,      # (n,) x, fp32/fp16/bf16                          reads 4n
    res_ptr,    # (n,) fp32 residual, in place (if HAS_RES)        reads 4n, writes 4n
    scale_ptr,  # (S,) fp32 per-segment scaler                     gathered (cached)
    seg_ptr,    # (n,) int32/int64 segment id per element          reads 8n (int64)
    seeds_ptr,  # (S,) int64 per-segment seed (if PER_SEG)         gathered (cached)
    starts_ptr, # (S,) int64 first element of each segment (if PER_SEG)
    out_ptr,    # (n/4,) uint8 codes, 4 per byte, LSB first        writes n/4
    seed, nbytes,
    HAS_RES: tl.constexpr,
    PER_SEG: tl.constexpr,  # a stream per segment (else one stream, ``seed``, over x)
    BYTES: tl.constexpr,  # bytes per program (4 * BYTES elements)
):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    sub = tl.arange(0, 4)
    bmask = byte < nbytes
    eoff = byte[:, None] * 4 + sub[None, :]                     # (BYTES, 4) element index
    emask = bmask[:, None] & (sub[None, :] < 4)
    y = tl.load(x_ptr + eoff, mask=emask, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(res_ptr + eoff, mask=emask, other=0.0)
    sid = tl.load(seg_ptr + eoff, mask=emask, other=0)
    s = tl.load(scale_ptr + sid, mask=emask, other=0.0)
    if PER_SEG:
        # the segment's own stream, counted from its first element (the reference's
        # j = i - starts[k]), whatever the block size or the segment's place
        sd = tl.load(seeds_ptr + sid, mask=emask, other=0)
        j = eoff - tl.load(starts_ptr + sid, mask=emask, other=0)
    else:
        sd = seed
        j = eoff  # one stream over x: the same whatever the block size
    # element j draws word j % 4 of Philox at counter j // 4 (reference.ternary_uniforms)
    u0, u1, u2, u3 = tl.rand4x(sd, j >> 2)
    w = j & 3
    u = tl.where(w == 0, u0, tl.where(w == 1, u1, tl.where(w == 2, u2, u3)))
    keep = u * s < tl.abs(y)
    nonneg = y >= 0
    code = tl.where(keep, tl.where(nonneg, 1, 2), 0)
    packed = tl.sum(code << (2 * sub)[None, :], axis=1)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=bmask)
    if HAS_RES:
        q = tl.where(keep, tl.where(nonneg, s, -s), 0.0)
        tl.store(res_ptr + eoff, y - q, mask=emask)


def ternary_compress(x: torch.Tensor, residual: torch.Tensor | None, scale: torch.Tensor,
                     seg: torch.Tensor, seed, starts: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.ternary_compress` (the same uniforms:
    ``tl.rand4x``'s words are the reference's :func:`~gradcomp.kernels.reference.philox_uniform`
    with ``word``). Reads 4n + 4n +
    8n (int64 seg), writes 4n + n/4."""
    c.check_flat(x)
    n = x.numel()
    if n % 4:
        raise ValueError(f"ternary_compress needs n % 4 == 0, got n={n}")
    c.check_flat(seg, "seg")
    c.check_contiguous(scale, "scale")
    if seg.numel() != n:
        raise ValueError(f"seg has {seg.numel()} elements, x has {n}")
    if residual is not None:
        c.check_fp32(residual, "residual", n)
    per_seg = isinstance(seed, torch.Tensor)
    if per_seg:
        if starts is None:
            raise ValueError("per-segment seeds need the segments' starts")
        for t, what in ((seed, "seed"), (starts, "starts")):
            c.check_flat(t, what)
            if t.dtype != torch.int64 or t.numel() != scale.numel():
                raise ValueError(f"{what} must be int64 with one entry per segment "
                                 f"({scale.numel()}), got {t.dtype} with {t.numel()}")
    out = c.alloc((n // 4,), torch.uint8, x.device)
    if n == 0:
        return out
    width = c.BLOCK // 4
    res = residual if residual is not None else x
    seeds, first = (seed, starts) if per_seg else (seg, seg)  # unread without PER_SEG
    _ternary_compress_kernel[(triton.cdiv(n // 4, width),)](
        x, res, scale, seg, seeds, first, out, 0 if per_seg else int(seed) & c.U64, n // 4,
        HAS_RES=residual is not None, PER_SEG=per_seg, BYTES=width, num_warps=c.NUM_WARPS)
    return out


@triton.jit
def _ternary_decompress_kernel(
    packed_ptr,  # (W, row) uint8 codes, row >= n/4 bytes per message   reads W n/4
    scale_ptr,   # (W, S) fp32 scalers                                  gathered (cached)
    seg_ptr,     # (n,) int32/int64 segment ids                         reads 8n (int64)
    out_ptr,     # (n,) accumulator, in place                           reads 4n, writes 4n
    n, row, S, W, alpha,
    BYTES: tl.constexpr,  # bytes per program (4 * BYTES elements)
    ACCUMULATE: tl.constexpr,  # False: out is written, not read
):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    sub = tl.arange(0, 4)
    eoff = byte[:, None] * 4 + sub[None, :]
    emask = eoff < n                      # n need not be a multiple of 4 here
    bmask = byte * 4 < n
    seg = tl.load(seg_ptr + eoff, mask=emask, other=0)
    acc = tl.zeros((BYTES, 4), tl.float32)
    pp = packed_ptr + byte
    sp = scale_ptr + seg
    for _ in range(W):
        code = (tl.load(pp, mask=bmask, other=0).to(tl.int32)[:, None] >> (2 * sub)[None, :]) & 3
        s = tl.load(sp, mask=emask, other=0.0)
        acc += tl.where(code == 1, s, tl.where(code == 2, -s, 0.0))
        pp += row
        sp += S
    store_sum(out_ptr, eoff, emask, alpha * acc, ACCUMULATE)


def ternary_decompress(packed: torch.Tensor, scale: torch.Tensor, seg: torch.Tensor,
                       out: torch.Tensor, alpha: float = 1.0,
                       accumulate: bool = True) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.ternary_decompress`. One pass over out (written
    without being read where ``accumulate`` is False: what a zeroed out would get)."""
    c.check_flat(out, "out")
    c.check_flat(seg, "seg")
    c.check_contiguous(packed, "packed")
    c.check_contiguous(scale, "scale")
    n = out.numel()
    if packed.dim() != 2 or scale.dim() != 2 or scale.shape[0] != packed.shape[0]:
        raise ValueError(f"need packed (W, >= n/4) and scale (W, S), got {tuple(packed.shape)} "
                         f"and {tuple(scale.shape)}")
    W, row = packed.shape
    if 4 * row < n or seg.numel() != n:
        raise ValueError(f"packed rows of {row} bytes / seg of {seg.numel()} do not cover out "
                         f"of {n} elements")
    if n == 0 or W == 0:
        return out
    width = c.BLOCK // 4
    _ternary_decompress_kernel[(triton.cdiv(n, 4 * width),)](
        packed, scale, seg, out, n, row, scale.shape[1], W, float(alpha),
        BYTES=width, ACCUMULATE=bool(accumulate), num_warps=c.NUM_WARPS)
    return out
