"""1-bit SGD's Triton kernels (compressors/onebit.py): onebit_compress and
onebit_decompress, as kernels/reference.py specifies them (see kernels/triton/__init__.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common as c
from .common import store_sum


# --------------------------------------------------------------------------- 1-bit SGD
@triton.jit
def _onebit_compress_rows(
    x_ptr,       # (n,) x, fp32/fp16/bf16                        reads 4n
    res_ptr,     # (n,) fp32 residual, in place (if HAS_RES)      reads 4n, writes 4n
    bits_ptr,    # (n/8,) uint8 signs y >= 0, LSB first           writes n/8
    scales_ptr,  # (2, nchunks) fp32: mean of y >= 0, of y < 0    writes 8n/chunk
    nchunks, cbytes,  # chunks; bytes per chunk (= chunk / 8)
    HAS_RES: tl.constexpr,
    ROWS: tl.constexpr,   # whole chunks per program
    BYTES: tl.constexpr,  # next power of two >= cbytes
):
    """Chunks that fit in registers: ROWS chunks per program, each read and written once."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    byte = tl.arange(0, BYTES)
    bit = tl.arange(0, 8)
    boff = rows[:, None] * cbytes + byte[None, :]                    # (ROWS, BYTES)
    bmask = (rows[:, None] < nchunks) & (byte[None, :] < cbytes)
    eoff = boff[:, :, None] * 8 + bit[None, None, :]                 # (ROWS, BYTES, 8)
    emask = bmask[:, :, None] & (bit[None, None, :] < 8)
    y = tl.load(x_ptr + eoff, mask=emask, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(res_ptr + eoff, mask=emask, other=0.0)
    pos = (y >= 0) & emask
    neg = (y < 0) & emask
    psum = tl.sum(tl.sum(tl.where(pos, y, 0.0), axis=2), axis=1)
    nsum = tl.sum(tl.sum(tl.where(neg, y, 0.0), axis=2), axis=1)
    npos = tl.sum(tl.sum(pos.to(tl.int32), axis=2), axis=1)
    nneg = tl.sum(tl.sum(neg.to(tl.int32), axis=2), axis=1)
    sp = psum / tl.maximum(npos, 1).to(tl.float32)
    sn = nsum / tl.maximum(nneg, 1).to(tl.float32)
    rmask = rows < nchunks
    tl.store(scales_ptr + rows, sp, mask=rmask)
    tl.store(scales_ptr + nchunks + rows, sn, mask=rmask)
    packed = tl.sum(pos.to(tl.int32) << bit[None, None, :], axis=2)
    tl.store(bits_ptr + boff, packed.to(tl.uint8), mask=bmask)
    if HAS_RES:
        deq = tl.where(y >= 0, sp[:, None, None], sn[:, None, None])
        tl.store(res_ptr + eoff, y - deq, mask=emask)


@triton.jit
def _onebit_compress_long(
    x_ptr,       # (n,) x, fp32/fp16/bf16                        reads 2 x 4n (second from L2)
    res_ptr,     # (n,) fp32 residual, in place (if HAS_RES)      reads 2 x 4n, writes 4n
    bits_ptr,    # (n/8,) uint8 signs, LSB first                  writes n/8
    scales_ptr,  # (2, nchunks) fp32                              writes 8n/chunk
    nchunks, cbytes,
    HAS_RES: tl.constexpr,
    BYTES: tl.constexpr,  # bytes per tile (8 * BYTES elements)
):
    """Chunks longer than a block: one program per chunk, a summing sweep then a writing one."""
    row = tl.program_id(0).to(tl.int64)
    byte = tl.arange(0, BYTES)
    bit = tl.arange(0, 8)
    psum = tl.zeros((BYTES, 8), tl.float32)
    nsum = tl.zeros((BYTES, 8), tl.float32)
    npos = tl.zeros((BYTES, 8), tl.int32)
    for start in range(0, cbytes, BYTES):
        b = start + byte
        eoff = (row * cbytes + b)[:, None] * 8 + bit[None, :]
        emask = (b[:, None] < cbytes) & (bit[None, :] < 8)
        y = tl.load(x_ptr + eoff, mask=emask, other=0.0).to(tl.float32)
        if HAS_RES:
            y += tl.load(res_ptr + eoff, mask=emask, other=0.0)
        pos = (y >= 0) & emask
        psum += tl.where(pos, y, 0.0)
        nsum += tl.where((y < 0) & emask, y, 0.0)
        npos += pos.to(tl.int32)
    np_ = tl.sum(tl.sum(npos, axis=1), axis=0)
    nn_ = cbytes * 8 - np_
    sp = tl.sum(tl.sum(psum, axis=1), axis=0) / tl.maximum(np_, 1).to(tl.float32)
    sn = tl.sum(tl.sum(nsum, axis=1), axis=0) / tl.maximum(nn_, 1).to(tl.float32)
    tl.store(scales_ptr + row, sp)
    tl.store(scales_ptr + nchunks + row, sn)
    for start in range(0, cbytes, BYTES):
        b = start + byte
        bmask = b < cbytes
        eoff = (row * cbytes + b)[:, None] * 8 + bit[None, :]
        emask = bmask[:, None] & (bit[None, :] < 8)
        y = tl.load(x_ptr + eoff, mask=emask, other=0.0).to(tl.float32)
        if HAS_RES:
            y += tl.load(res_ptr + eoff, mask=emask, other=0.0)
        pos = y >= 0
        packed = tl.sum((pos & emask).to(tl.int32) << bit[None, :], axis=1)
        tl.store(bits_ptr + row * cbytes + b, packed.to(tl.uint8), mask=bmask)
        if HAS_RES:
            tl.store(res_ptr + eoff, y - tl.where(pos, sp, sn), mask=emask)


def onebit_compress(x: torch.Tensor, residual: torch.Tensor | None, chunk: int):
    """See :func:`gradcomp.kernels.reference.onebit_compress`. Reads 2n*4, writes n*4 + n/8."""
    c.check_flat(x)
    n = x.numel()
    if chunk <= 0 or chunk % 8 or n % chunk:
        raise ValueError(f"need chunk % 8 == 0 and n % chunk == 0, got n={n}, chunk={chunk}")
    if residual is not None:
        c.check_fp32(residual, "residual", n)
    nchunks, cbytes = n // chunk, chunk // 8
    bits = c.alloc((n // 8,), torch.uint8, x.device)
    scales = c.alloc((2, nchunks), torch.float32, x.device)
    if n == 0:
        return bits, scales
    res = residual if residual is not None else x  # never touched when HAS_RES is False
    width = triton.next_power_of_2(cbytes)
    if 8 * width <= c.BLOCK:
        rows = c.BLOCK // (8 * width)
        _onebit_compress_rows[(triton.cdiv(nchunks, rows),)](
            x, res, bits, scales, nchunks, cbytes, HAS_RES=residual is not None,
            ROWS=rows, BYTES=width, num_warps=c.NUM_WARPS)
    else:
        _onebit_compress_long[(nchunks,)](
            x, res, bits, scales, nchunks, cbytes, HAS_RES=residual is not None,
            BYTES=c.BLOCK // 8, num_warps=c.NUM_WARPS)
    return bits, scales


@triton.jit
def _onebit_decompress_kernel(
    bits_ptr,    # (W, n/8) uint8 packed signs                    reads W n/8
    scales_ptr,  # (W, 2, nchunks) fp32                           reads 8 W n/chunk (cached)
    out_ptr,     # (n,) accumulator, in place                     reads 4n, writes 4n
    nbytes, nchunks, cbytes, W, alpha,
    BYTES: tl.constexpr,  # bytes per program (8 * BYTES elements)
    ACCUMULATE: tl.constexpr,  # False: out is written, not read
):
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    bit = tl.arange(0, 8)
    bmask = byte < nbytes
    chunk_id = byte // cbytes  # chunk % 8 == 0: the 8 elements of a byte share a chunk
    acc = tl.zeros((BYTES, 8), tl.float32)
    bp = bits_ptr + byte
    sp = scales_ptr + chunk_id
    for _ in range(W):  # pointers advance per message: no int32 overflow in w * nbytes
        b = tl.load(bp, mask=bmask, other=0).to(tl.int32)
        hi = tl.load(sp, mask=bmask, other=0.0)
        lo = tl.load(sp + nchunks, mask=bmask, other=0.0)
        on = ((b[:, None] >> bit[None, :]) & 1) != 0
        acc += tl.where(on, hi[:, None], lo[:, None])
        bp += nbytes
        sp += 2 * nchunks
    eoff = byte[:, None] * 8 + bit[None, :]
    emask = bmask[:, None] & (bit[None, :] < 8)
    store_sum(out_ptr, eoff, emask, alpha * acc, ACCUMULATE)


def onebit_decompress(bits: torch.Tensor, scales: torch.Tensor, chunk: int, out: torch.Tensor,
                      alpha: float = 1.0, accumulate: bool = True) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.onebit_decompress`. One pass over out (written
    without being read where ``accumulate`` is False: what a zeroed out would get)."""
    c.check_flat(out, "out")
    c.check_contiguous(bits, "bits")
    c.check_contiguous(scales, "scales")
    n = out.numel()
    if chunk <= 0 or chunk % 8 or n % chunk:
        raise ValueError(f"need chunk % 8 == 0 and n % chunk == 0, got n={n}, chunk={chunk}")
    W, nchunks = bits.shape[0], n // chunk
    if tuple(bits.shape) != (W, n // 8) or tuple(scales.shape) != (W, 2, nchunks):
        raise ValueError(f"bits {tuple(bits.shape)} / scales {tuple(scales.shape)} do not match "
                         f"out of {n} elements in chunks of {chunk}")
    if n == 0 or W == 0:
        return out
    width = c.BLOCK // 8
    _onebit_decompress_kernel[(triton.cdiv(n // 8, width),)](
        bits, scales, out, n // 8, nchunks, chunk // 8, W, float(alpha),
        BYTES=width, ACCUMULATE=bool(accumulate), num_warps=c.NUM_WARPS)
    return out
