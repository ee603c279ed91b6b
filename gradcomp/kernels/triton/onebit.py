"""1-bit SGD's Triton kernels (compressors/onebit.py): onebit_compress and
onebit_decompress over a flat buffer of whole chunks; onebit_encode, onebit_reencode and
onebit_decode, the GPU path's exchange, one launch per phase for a whole bucket; as
kernels/reference.py specifies them (see kernels/triton/__init__.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
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


# --------------------------------------------------------------------------- the exchange's steps
# onebit_encode / onebit_reencode / onebit_decode (kernels/reference.py specifies them): one
# launch each for a whole bucket, reading and writing the bucket's own layout through the
# slot chunks' tables (starts, reals), so the count does not grow with the parameters. A
# program takes ROWS whole chunks (a tile of (ROWS, BYTES, 8) elements), or where a chunk is
# longer than a block (LONG) one chunk in tiles of BYTES bytes: a summing sweep (partial sums
# per element of the tile, as onebit_compress's long kernel adds them), then a writing one
# that computes y again (from L2). Programs past the chunks' take the elements
# of ``rest`` (the dense parameters and gaps), RBLOCK each.
@triton.jit
def _bf16_bits(v):
    """v (fp32, finite) rounded to bfloat16, nearest even: (its 16 bits as int32, its fp32
    value). Integer arithmetic: what the interpreter runs too."""
    b = v.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return r, (r << 16).to(tl.float32, bitcast=True)


@triton.jit
def _load_scale(ptr, mask, HALF: tl.constexpr):
    """A scale from a message field: fp32, or bfloat16 stored as int16 (HALF)."""
    if HALF:
        h = tl.load(ptr, mask=mask, other=0).to(tl.int32)
        return (h << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _decoded(bits_ptr, scales_ptr, rows, cpr, cbytes, byte, bit, rmask, HALF: tl.constexpr):
    """The values of message chunks ``rows`` (ROWS,) of a row at bits_ptr / scales_ptr (chunk
    i: signs at byte i * cbytes, scales at i and cpr + i), bytes ``byte`` (ROWS, BYTES) of
    each: (ROWS, BYTES, 8) fp32 (0 where the byte is masked off)."""
    bmask = rmask[:, None] & (byte < cbytes)
    b = tl.load(bits_ptr + rows[:, None] * cbytes + byte, mask=bmask, other=0).to(tl.int32)
    hi = _load_scale(scales_ptr + rows, rmask, HALF)
    lo = _load_scale(scales_ptr + cpr + rows, rmask, HALF)
    on = ((b[:, :, None] >> bit[None, None, :]) & 1) != 0
    return tl.where(on, hi[:, None, None], lo[:, None, None])


@triton.jit
def _y_bucket(x_ptr, res_ptr, at, real, HAS_RES: tl.constexpr):
    """Phase 1's y at bucket positions ``at`` where ``real``, 0 elsewhere."""
    y = tl.load(x_ptr + at, mask=real, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(res_ptr + at, mask=real, other=0.0)
    return y


@triton.jit
def _y_messages(got_ptr, gscales_ptr, W, grow, gsrow, alpha, srv_ptr, i, cpr, cbytes, byte,
                bit, rmask, at, real, HAS_RES: tl.constexpr, HALF: tl.constexpr):
    """Phase 2's y: alpha * the sum of the W messages' values (in rank order), 0 at the
    padding, + the second memory at the real elements."""
    acc = tl.zeros(at.shape, tl.float32)
    bp = got_ptr
    sp = gscales_ptr
    for _ in range(W):  # pointers advance per message: no int32 overflow in w * grow
        acc += _decoded(bp, sp, i, cpr, cbytes, byte, bit, rmask, HALF)
        bp += grow
        sp += gsrow
    v = acc * alpha
    y = tl.where(real & (v != 0.0), v, 0.0)  # -0.0 as +0.0: what a decoded buffer held
    if HAS_RES:
        y += tl.load(srv_ptr + at, mask=real, other=0.0)
    return y


@triton.jit
def _sums(y, real):
    """Per chunk of a (ROWS, BYTES, 8) tile: (sum of y >= 0, of y < 0, count of real y >= 0,
    of y < 0). The padding is 0: in neither sum, and counted in neither."""
    pos = y >= 0
    return (_total(tl.where(pos, y, 0.0)), _total(tl.where(pos, 0.0, y)),
            _total((pos & real).to(tl.int32)), _total((y < 0).to(tl.int32)))


@triton.jit
def _total(t):
    """Per row of a (ROWS, BYTES, 8) tile: its sum, over the bits, then the bytes."""
    return tl.sum(tl.sum(t, axis=2), axis=1)


@triton.jit
def _put_scales(scales_ptr, i, cpr, rmask, psum, nsum, npos, nneg, HALF: tl.constexpr):
    """The two means of chunks i (ROWS,) into a row's scales field; returns them as the
    decoder will read them (rounded to bfloat16 where HALF)."""
    sp = psum / tl.maximum(npos, 1).to(tl.float32)
    sn = nsum / tl.maximum(nneg, 1).to(tl.float32)
    if HALF:
        hp, sp = _bf16_bits(sp)
        hn, sn = _bf16_bits(sn)
        tl.store(scales_ptr + i, hp.to(tl.int16), mask=rmask)
        tl.store(scales_ptr + cpr + i, hn.to(tl.int16), mask=rmask)
    else:
        tl.store(scales_ptr + i, sp, mask=rmask)
        tl.store(scales_ptr + cpr + i, sn, mask=rmask)
    return sp, sn


@triton.jit
def _put_tile(y, bits_ptr, i, cbytes, byte, bit, rmask, sp, sn, out_ptr, at, real,
              HAS_OUT: tl.constexpr):
    """A tile's signs into a row's signs (chunks i, bytes ``byte``) and y - its dequantized
    value into out_ptr at ``at`` where ``real``."""
    pos = y >= 0
    packed = tl.sum(pos.to(tl.int32) << bit[None, None, :], axis=2)
    bmask = rmask[:, None] & (byte < cbytes)
    tl.store(bits_ptr + i[:, None] * cbytes + byte, packed.to(tl.uint8), mask=bmask)
    if HAS_OUT:
        tl.store(out_ptr + at, y - tl.where(pos, sp[:, None, None], sn[:, None, None]), mask=real)


@triton.jit
def _zero_pad(msg_ptr, i, cpr, cbytes, scales_at, rmask):
    """The zero bytes between a row's signs and its scales, by its last chunk's program."""
    t = (cpr * cbytes + tl.arange(0, 4))[None, :]
    last = (rmask & (i == cpr - 1))[:, None]
    tl.store(msg_ptr + t + 0 * i[:, None], tl.zeros((1, 4), tl.uint8), mask=last & (t < scales_at))


@triton.jit
def _y(src_ptr, res_ptr, gscales_ptr, W, grow, gsrow, alpha, i, cpr, cbytes, byte, bit, rmask,
       at, real, DECODE: tl.constexpr, HAS_RES: tl.constexpr, HALF: tl.constexpr):
    """A tile's y: phase 1's from the bucket src_ptr (x), phase 2's from the W messages at
    src_ptr (DECODE); res_ptr the memory added."""
    if DECODE:
        y = _y_messages(src_ptr, gscales_ptr, W, grow, gsrow, alpha, res_ptr, i, cpr, cbytes,
                        byte, bit, rmask, at, real, HAS_RES, HALF)
    else:
        y = _y_bucket(src_ptr, res_ptr, at, real, HAS_RES)
    return y


@triton.jit
def _quantize(src_ptr, res_ptr, out_ptr, zero_ptr, gscales_ptr, W, grow, gsrow, alpha, bits_ptr,
              scales_ptr, i, cpr, cbytes, rmask, start, nreal, others, DECODE: tl.constexpr,
              HAS_RES: tl.constexpr, HAS_ZERO: tl.constexpr, HALF: tl.constexpr,
              LONG: tl.constexpr, ROWS: tl.constexpr, BYTES: tl.constexpr):
    """Chunks i (ROWS,) of a row (signs at bits_ptr, scales at scales_ptr), their elements at
    start (ROWS, 1, 1) in the bucket, nreal of them real: y (:func:`_y`), its signs and two
    means into the row, y - its dequantized value into out_ptr (HAS_RES), 0 into zero_ptr
    where ``others`` (HAS_ZERO). LONG: one chunk in tiles, a summing sweep then a writing one
    that computes y again."""
    byte0 = tl.arange(0, BYTES)[None, :]
    bit = tl.arange(0, 8)
    if LONG:  # per element of the tile, summed over the tiles, then over the tile
        psum = tl.zeros((ROWS, BYTES, 8), tl.float32)
        nsum = tl.zeros((ROWS, BYTES, 8), tl.float32)
        npos = tl.zeros((ROWS, BYTES, 8), tl.int32)
        nneg = tl.zeros((ROWS, BYTES, 8), tl.int32)
        for s in range(0, cbytes, BYTES):
            col = (s + byte0)[:, :, None] * 8 + bit[None, None, :]
            real = col < nreal
            y = _y(src_ptr, res_ptr, gscales_ptr, W, grow, gsrow, alpha, i, cpr, cbytes, s + byte0,
                   bit, rmask, start + col, real, DECODE, HAS_RES, HALF)
            psum += tl.where(y >= 0, y, 0.0)
            nsum += tl.where(y >= 0, 0.0, y)
            npos += ((y >= 0) & real).to(tl.int32)
            nneg += (y < 0).to(tl.int32)
        psum, nsum, npos, nneg = _total(psum), _total(nsum), _total(npos), _total(nneg)
        hi, lo = _put_scales(scales_ptr, i, cpr, rmask, psum, nsum, npos, nneg, HALF)
        for s in range(0, cbytes, BYTES):
            col = (s + byte0)[:, :, None] * 8 + bit[None, None, :]
            real = col < nreal
            y = _y(src_ptr, res_ptr, gscales_ptr, W, grow, gsrow, alpha, i, cpr, cbytes, s + byte0,
                   bit, rmask, start + col, real, DECODE, HAS_RES, HALF)
            _put_tile(y, bits_ptr, i, cbytes, s + byte0, bit, rmask, hi, lo, out_ptr, start + col,
                      real, HAS_RES)
            if HAS_ZERO:
                tl.store(zero_ptr + start + col, tl.zeros(y.shape, tl.float32), mask=real & others)
    else:
        col = byte0[:, :, None] * 8 + bit[None, None, :]
        real = col < nreal
        y = _y(src_ptr, res_ptr, gscales_ptr, W, grow, gsrow, alpha, i, cpr, cbytes, byte0, bit,
               rmask, start + col, real, DECODE, HAS_RES, HALF)
        psum, nsum, npos, nneg = _sums(y, real)
        hi, lo = _put_scales(scales_ptr, i, cpr, rmask, psum, nsum, npos, nneg, HALF)
        _put_tile(y, bits_ptr, i, cbytes, byte0, bit, rmask, hi, lo, out_ptr, start + col, real,
                  HAS_RES)
        if HAS_ZERO:
            tl.store(zero_ptr + start + col, tl.zeros(y.shape, tl.float32), mask=real & others)


@triton.jit
def _onebit_encode_kernel(
    x_ptr,       # (n,) the bucket, fp32                                   reads 4n
    res_ptr,     # (n,) fp32 residual (if HAS_RES)                         reads 4n
    rnext_ptr,   # (n,) fp32 its next buffer (may be res_ptr)              writes 4n
    snext_ptr,   # (n,) fp32 the second memory's next buffer (if HAS_SERVER): 0 but row rank's
    starts_ptr,  # (C,) int64 each slot chunk's first element in the bucket
    reals_ptr,   # (C,) int32 its real elements
    msg_ptr,     # (W, row) uint8 the message: signs from byte 0 of each row      writes n/8
    scales_ptr,  # its scales fields (fp32, or int16 holding bfloat16), row stride srow
    rest_ptr,    # (nrest,) int64 the elements outside the compressed parameters, dense first
    dense_ptr,   # (ndense,) fp32 out: x at rest[:ndense]
    C, cpr, cbytes, row, srow, scales_at, nrest, ndense, rank, nprog,
    HAS_RES: tl.constexpr, HAS_SERVER: tl.constexpr, HALF: tl.constexpr, LONG: tl.constexpr,
    ROWS: tl.constexpr, BYTES: tl.constexpr, RBLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < nprog:
        c = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)  # slot chunks
        rmask = c < C
        start = tl.load(starts_ptr + c, mask=rmask, other=0)[:, None, None]
        nreal = tl.load(reals_ptr + c, mask=rmask, other=0)[:, None, None]
        j = c // cpr  # the message row
        i = c - j * cpr  # the chunk within it
        mp = msg_ptr + j[:, None] * row  # (ROWS, 1): each chunk's row
        _zero_pad(mp, i, cpr, cbytes, scales_at, rmask)
        _quantize(x_ptr, res_ptr, rnext_ptr, snext_ptr, scales_ptr, 1, 0, 0, 1.0, mp,
                  scales_ptr + j * srow, i, cpr, cbytes, rmask, start, nreal,
                  (j != rank)[:, None, None], False, HAS_RES, HAS_SERVER, HALF, LONG, ROWS, BYTES)
    else:
        k = (pid - nprog).to(tl.int64) * RBLOCK + tl.arange(0, RBLOCK)
        kmask = k < nrest
        at = tl.load(rest_ptr + k, mask=kmask, other=0)
        if HAS_RES:
            tl.store(rnext_ptr + at, tl.zeros((RBLOCK,), tl.float32), mask=kmask)
        if HAS_SERVER:
            tl.store(snext_ptr + at, tl.zeros((RBLOCK,), tl.float32), mask=kmask)
        dmask = k < ndense
        tl.store(dense_ptr + k, tl.load(x_ptr + at, mask=dmask, other=0.0), mask=dmask)


@triton.jit
def _onebit_reencode_kernel(
    got_ptr,      # (W, grow) uint8 every rank's message for this rank's part     reads W n/8W
    gscales_ptr,  # their scales fields, row stride gsrow
    srv_ptr,      # (n,) fp32 the second memory (if HAS_RES)                       reads 4n/W
    snext_ptr,    # (n,) fp32 its next buffer (may be srv_ptr)                     writes 4n/W
    starts_ptr,   # (cpr,) int64 the part's chunks in the bucket ...
    reals_ptr,    # (cpr,) int32 ... and their real elements
    msg_ptr,      # (row,) uint8 out: this rank's phase-2 message (signs and scales) writes n/8W
    scales_ptr,   # its scales field
    W, cpr, cbytes, grow, gsrow, scales_at, alpha,
    HAS_RES: tl.constexpr, HALF: tl.constexpr, LONG: tl.constexpr,
    ROWS: tl.constexpr, BYTES: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # chunks of the part
    rmask = i < cpr
    start = tl.load(starts_ptr + i, mask=rmask, other=0)[:, None, None]
    nreal = tl.load(reals_ptr + i, mask=rmask, other=0)[:, None, None]
    _zero_pad(msg_ptr, i, cpr, cbytes, scales_at, rmask)
    _quantize(got_ptr, srv_ptr, snext_ptr, snext_ptr, gscales_ptr, W, grow, gsrow, alpha, msg_ptr,
              scales_ptr, i, cpr, cbytes, rmask, start, nreal, rmask[:, None, None], True,
              HAS_RES, False, HALF, LONG, ROWS, BYTES)


@triton.jit
def _onebit_decode_kernel(
    msg_ptr,     # (W, row) uint8 every rank's phase-2 message                   reads n/8
    scales_ptr,  # their scales fields, row stride srow
    starts_ptr,  # (C,) int64 each slot chunk's first element in the bucket
    reals_ptr,   # (C,) int32 its real elements
    out_ptr,     # (n,) fp32 the bucket, written                                 writes 4n
    rest_ptr,    # (nrest,) int64 the elements outside the compressed parameters, dense first
    dense_ptr,   # (W, ndense) fp32 every rank's dense values, row stride drow
    flag_ptr,    # fp32, the guard's flag: every value written NaN where [0] > 0 (HAS_FLAG)
    clear_ptr,   # fp32, the guard's other flag: [0] = 0 by program 0 (HAS_FLAG)
    C, cpr, cbytes, row, srow, nrest, ndense, drow, W, inv, nprog,
    HALF: tl.constexpr, ROWS: tl.constexpr, BYTES: tl.constexpr, RBLOCK: tl.constexpr,
    HAS_FLAG: tl.constexpr,
):
    pid = tl.program_id(0)
    up = False
    if HAS_FLAG:
        up = tl.load(flag_ptr) > 0
        if pid == 0:
            tl.store(clear_ptr, 0.0)
    if pid < nprog:
        c = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = c < C
        start = tl.load(starts_ptr + c, mask=rmask, other=0)[:, None, None]
        nreal = tl.load(reals_ptr + c, mask=rmask, other=0)[:, None, None]
        j = c // cpr
        i = c - j * cpr
        byte0 = tl.arange(0, BYTES)[None, :]
        bit = tl.arange(0, 8)
        for s in range(0, cbytes, BYTES):
            byte = s + byte0
            col = byte[:, :, None] * 8 + bit[None, None, :]
            v = _decoded(msg_ptr + (j * row)[:, None], scales_ptr + j * srow, i, cpr, cbytes,
                         byte, bit, rmask, HALF)
            v = tl.where(v == 0.0, 0.0, v)
            if HAS_FLAG:
                v = tl.where(up, float("nan"), v)
            tl.store(out_ptr + start + col, v, mask=col < nreal)
    else:
        k = (pid - nprog).to(tl.int64) * RBLOCK + tl.arange(0, RBLOCK)
        kmask = k < nrest
        at = tl.load(rest_ptr + k, mask=kmask, other=0)
        dmask = k < ndense
        acc = tl.load(dense_ptr + k, mask=dmask, other=0.0)
        dp = dense_ptr
        for _ in range(1, W):
            dp += drow
            acc += tl.load(dp + k, mask=dmask, other=0.0)
        v = tl.where(dmask, acc * inv, 0.0)
        if HAS_FLAG:
            v = tl.where(up, float("nan"), v)
        tl.store(out_ptr + at, v, mask=kmask)


def _tiles(chunk: int):
    """(LONG, ROWS, BYTES) for chunks of ``chunk`` elements: whole chunks per program while
    one fits in a block, else one chunk per program in tiles of a block."""
    width = triton.next_power_of_2(chunk // 8)
    if 8 * width <= c.BLOCK:
        return False, c.BLOCK // (8 * width), width
    return True, 1, c.BLOCK // 8


def _scales_field(msg: torch.Tensor, scales_at: int, count: int, dtype) -> torch.Tensor:
    """Each row's scales field of msg (R, nbytes): fp32, or bfloat16's bits as int16."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"scale_dtype must be float32 or bfloat16, got {dtype}")
    size = 4 if dtype == torch.float32 else 2
    if msg.dim() == 2 and msg.dtype == torch.uint8 and count == 0:  # no chunks: not read
        return msg.new_empty(msg.shape[0], 0, dtype=torch.float32 if size == 4 else torch.int16)
    if msg.dim() != 2 or msg.dtype != torch.uint8 or msg.stride(1) != 1 \
            or (msg.shape[0] > 1 and msg.stride(0) % size) or scales_at % size \
            or msg.shape[1] < scales_at + count * size:
        raise ValueError(f"a message must be (rows, bytes) uint8 with contiguous rows of "
                         f"{scales_at + count * size} bytes or more, its scales at {scales_at} "
                         f"aligned for {dtype}; got {tuple(msg.shape)} {msg.dtype} with strides "
                         f"{msg.stride()}")
    return msg[:, scales_at : scales_at + count * size].view(
        torch.float32 if size == 4 else torch.int16)


def _check_slots(starts, reals, chunk, C=None):
    if chunk <= 0 or chunk % 8:
        raise ValueError(f"chunk must be a positive multiple of 8, got {chunk}")
    c.check_flat(starts, "starts")
    c.check_flat(reals, "reals")
    if starts.dtype != torch.int64 or reals.dtype != torch.int32 or reals.numel() != starts.numel() \
            or (C is not None and starts.numel() != C):
        raise ValueError(f"starts (int64) and reals (int32) must have one entry per chunk"
                         f"{'' if C is None else f' ({C})'}, got {starts.numel()} x {starts.dtype}"
                         f" and {reals.numel()} x {reals.dtype}")


def onebit_encode(x, residual, res_next, server_next, starts, reals, chunk: int, rank: int,
                  msg, scales_at: int, scale_dtype, rest, dense):
    """See :func:`gradcomp.kernels.reference.onebit_encode`. One launch: reads x and the
    residual once, writes the message, the residual's next buffer whole, the second memory's
    0's and the dense values."""
    c.check_flat(x)
    n = x.numel()
    if (residual is None) != (res_next is None):
        raise ValueError("residual and res_next go together (both None: no error feedback)")
    for t, name in ((residual, "residual"), (res_next, "res_next"), (server_next, "server_next")):
        if t is not None:
            c.check_fp32(t, name, n)
    W, C = msg.shape[0], starts.numel()
    _check_slots(starts, reals, chunk)
    if W == 0 or C % W:
        raise ValueError(f"{C} chunks do not cut into the message's {W} rows")
    cpr, cbytes = C // W, chunk // 8
    scales = _scales_field(msg, scales_at, 2 * cpr, scale_dtype)
    if scales_at < cpr * cbytes:
        raise ValueError(f"scales_at {scales_at} lies inside the {cpr * cbytes} bytes of signs")
    c.check_flat(rest, "rest")
    c.check_fp32(dense, "dense", dense.numel())
    if rest.dtype != torch.int64 or dense.numel() > rest.numel():
        raise ValueError(f"rest must be int64 holding the {dense.numel()} dense elements first, "
                         f"got {rest.numel()} x {rest.dtype}")
    LONG, ROWS, BYTES = _tiles(chunk)
    nprog = triton.cdiv(C, ROWS)
    grid = (nprog + triton.cdiv(rest.numel(), c.BLOCK),)
    if grid[0] == 0:
        return msg
    _onebit_encode_kernel[grid](
        x, x if residual is None else residual, x if res_next is None else res_next,
        x if server_next is None else server_next, starts, reals, msg, scales,
        rest if rest.numel() else starts, dense if dense.numel() else x,
        C, cpr, cbytes, msg.stride(0), scales.stride(0), scales_at, rest.numel(), dense.numel(),
        rank, nprog, HAS_RES=residual is not None, HAS_SERVER=server_next is not None,
        HALF=scale_dtype == torch.bfloat16, LONG=LONG, ROWS=ROWS, BYTES=BYTES, RBLOCK=c.BLOCK,
        num_warps=c.NUM_WARPS)
    return msg


def onebit_reencode(got, server, server_next, starts, reals, chunk: int, msg, scales_at: int,
                    scale_dtype):
    """See :func:`gradcomp.kernels.reference.onebit_reencode`. One launch: reads the W
    messages and the second memory's part once, writes the message and that part."""
    if (server is None) != (server_next is None):
        raise ValueError("server and server_next go together (both None: no error feedback)")
    for t, name in ((server, "server"), (server_next, "server_next")):
        if t is not None:
            c.check_fp32(t, name, t.numel())
    cpr = starts.numel()
    _check_slots(starts, reals, chunk)
    W, cbytes = got.shape[0], chunk // 8
    gscales = _scales_field(got, scales_at, 2 * cpr, scale_dtype)
    scales = _scales_field(msg, scales_at, 2 * cpr, scale_dtype)
    if msg.shape[0] != 1 or scales_at < cpr * cbytes:
        raise ValueError(f"msg must be one row, its scales at {cpr * cbytes} or after; got "
                         f"{tuple(msg.shape)}, scales_at {scales_at}")
    if W == 0 or cpr == 0:
        return msg
    LONG, ROWS, BYTES = _tiles(chunk)
    srv = server if server is not None else got
    _onebit_reencode_kernel[(triton.cdiv(cpr, ROWS),)](
        got, gscales, srv, server_next if server_next is not None else srv, starts, reals, msg,
        scales, W, cpr, cbytes, got.stride(0), gscales.stride(0), scales_at, float(1.0 / W),
        HAS_RES=server is not None, HALF=scale_dtype == torch.bfloat16, LONG=LONG, ROWS=ROWS,
        BYTES=BYTES, num_warps=c.NUM_WARPS)
    return msg


def onebit_decode(msgs, starts, reals, chunk: int, scales_at: int, scale_dtype, rest, dense,
                  out, verdict=None):
    """See :func:`gradcomp.kernels.reference.onebit_decode`. One launch: reads the messages
    once, writes every element of ``out`` that a chunk or ``rest`` names (the guard's verdict
    too, where given)."""
    c.check_flat(out, "out")
    flag, clear = (out, out) if verdict is None else verdict
    if verdict is not None:
        reference.check_guard(out, flag, x_name="out")
        reference.check_clear(flag, clear)
    if out.dtype != torch.float32:
        raise ValueError(f"out must be fp32, got {out.dtype}")
    W, C = msgs.shape[0], starts.numel()
    _check_slots(starts, reals, chunk)
    if W == 0 or C % W:
        raise ValueError(f"{C} chunks do not cut into the messages' {W} rows")
    cpr = C // W
    scales = _scales_field(msgs, scales_at, 2 * cpr, scale_dtype)
    c.check_flat(rest, "rest")
    if rest.dtype != torch.int64 or dense.dim() != 2 or dense.shape[0] != W \
            or dense.dtype != torch.float32 or dense.shape[1] > rest.numel() \
            or (dense.shape[1] and dense.stride(1) != 1):
        raise ValueError(f"rest must be int64, dense (W={W}, m <= {rest.numel()}) fp32 rows; "
                         f"got {rest.dtype}, {tuple(dense.shape)} {dense.dtype}")
    LONG, ROWS, BYTES = _tiles(chunk)
    nprog = triton.cdiv(C, ROWS)
    m = dense.shape[1]
    if nprog + rest.numel() == 0 and verdict is None:
        return out
    _onebit_decode_kernel[(max(nprog + triton.cdiv(rest.numel(), c.BLOCK), 1),)](
        msgs, scales, starts, reals, out, rest if rest.numel() else starts,
        dense if m else out, flag, clear, C, cpr, chunk // 8, msgs.stride(0), scales.stride(0),
        rest.numel(), m, dense.stride(0) if m else 0, W, reference.reciprocal(W), nprog,
        HALF=scale_dtype == torch.bfloat16, ROWS=ROWS, BYTES=BYTES, RBLOCK=c.BLOCK,
        HAS_FLAG=verdict is not None, num_warps=c.NUM_WARPS)
    return out
