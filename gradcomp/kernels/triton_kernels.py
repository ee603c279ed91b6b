"""Triton kernels for the quantize and select steps (CUDA tensors).

Every function here has the signature and semantics of the function of the same name in
:mod:`gradcomp.kernels.reference` (PowerSGD's: :mod:`gradcomp.kernels.lowrank`;
segment_candidates: the "cumsum" way of :mod:`gradcomp.kernels.segmented`), which is the
specification; the tests compare them. :mod:`gradcomp.kernels` imports this module lazily, for CUDA tensors only, so
the package imports without Triton. Under ``TRITON_INTERPRET=1`` the same kernels run on CPU
tensors (that is how the tests run without a GPU).

Passes over memory (n elements, fp32 x):
  * onebit_compress: one kernel, one read of x and the residual, one write of the residual,
    the packed signs and the per-chunk scales. Chunks longer than ``BLOCK`` elements take a
    second sweep over the chunk (the first one only sums), which for a chunk of tens of KiB
    is served from L2.
  * onebit_decompress / ternary_decompress: one kernel that decodes all W messages and adds
    them into ``out``: out is read and written once, each message read once.
  * ternary_compress: one kernel (2-bit codes, four per byte, residual in place).
  * select_topk: two short kernels over x (per-block counts; then an in-order compaction at
    each block's exclusive offset, found with a cumsum over the tiny count vector), then an
    exact ``torch.topk`` over the ``capacity`` candidates. Blocks past ``capacity`` stop
    after reading one offset. No host synchronization.
  * scatter_add: one kernel of atomic adds.
  * segment_candidates (the segmented top-k's candidate step, kernels/segmented.py): a
    count over x, a cumsum over the tiny per-block counts, one program per segment for the
    candidates before it, a compaction: two reads of x.
  * threshold_tau / threshold_encode / threshold_decode: threshold quantization's
    per-parameter tau, its codes and residual, and the decode of the W messages (atomic
    adds); each one launch over a bucket.
  * powersgd_project / _back / _expand / _orthonormalize: PowerSGD's matrix steps over a
    table of matrices of any shapes, one launch each (kernels/lowrank.py; float tolerance,
    not bit-identity, against its reference: a product's summation order is the kernel's).

Randomness. ``ternary_compress`` draws ``tl.rand`` (Philox4x32-10): per element i, key = the
seed and counter = i, or with per-segment seeds key = seeds[k] and counter = i - starts[k] for
an element of segment k. The reference computes the same stream in pure torch
(:func:`gradcomp.kernels.reference.philox_uniform`), so the kernel and the reference agree bit
for bit and a CPU run and a GPU run with the same seeds draw the same numbers.

Inputs: ``x`` may be fp32, fp16 or bf16 (loaded and upcast to fp32 in the kernel); the
residual, scales and accumulators are fp32. Flat inputs must be contiguous (``ValueError``
otherwise): a silent ``.contiguous()`` would copy a whole bucket.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .reference import check_flat

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Elements per program (a power of two, >= 64). Native: 2048 with 4 warps, chosen by a sweep
# on an H100 (bench/gpu_probe.py sweep, recorded in bench/RESULTS.md): at 25M elements it puts
# every quantize/pack/unpack kernel at 78-121% of the bandwidth of a copy of the same bytes, where
# 4096 left ternary_decompress at 60% and 16384 collapsed (register spills). The
# interpreter runs programs one after another in Python, so its cost is per program: 65536
# keeps a 4M-element test at a few seconds. Read at call time, so tests can shrink it to
# exercise many programs.
BLOCK = 65536 if _INTERPRET else 2048
NUM_WARPS = 4

_U64 = (1 << 64) - 1


def _alloc(shape, dtype, device) -> torch.Tensor:
    """Every output buffer comes from here (tests swap in guard-banded buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} with strides "
                         f"{t.stride()}; call .contiguous() first")


def _check_fp32(t: torch.Tensor, name: str, n: int) -> None:
    check_flat(t, name)
    if t.dtype != torch.float32 or t.numel() != n:
        raise ValueError(f"{name} must be fp32 with {n} elements, got {t.dtype} with {t.numel()}")


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
    check_flat(x)
    n = x.numel()
    if chunk <= 0 or chunk % 8 or n % chunk:
        raise ValueError(f"need chunk % 8 == 0 and n % chunk == 0, got n={n}, chunk={chunk}")
    if residual is not None:
        _check_fp32(residual, "residual", n)
    nchunks, cbytes = n // chunk, chunk // 8
    bits = _alloc((n // 8,), torch.uint8, x.device)
    scales = _alloc((2, nchunks), torch.float32, x.device)
    if n == 0:
        return bits, scales
    res = residual if residual is not None else x  # never touched when HAS_RES is False
    width = triton.next_power_of_2(cbytes)
    if 8 * width <= BLOCK:
        rows = BLOCK // (8 * width)
        _onebit_compress_rows[(triton.cdiv(nchunks, rows),)](
            x, res, bits, scales, nchunks, cbytes, HAS_RES=residual is not None,
            ROWS=rows, BYTES=width, num_warps=NUM_WARPS)
    else:
        _onebit_compress_long[(nchunks,)](
            x, res, bits, scales, nchunks, cbytes, HAS_RES=residual is not None,
            BYTES=BLOCK // 8, num_warps=NUM_WARPS)
    return bits, scales


@triton.jit
def _onebit_decompress_kernel(
    bits_ptr,    # (W, n/8) uint8 packed signs                    reads W n/8
    scales_ptr,  # (W, 2, nchunks) fp32                           reads 8 W n/chunk (cached)
    out_ptr,     # (n,) accumulator, in place                     reads 4n, writes 4n
    nbytes, nchunks, cbytes, W, alpha,
    BYTES: tl.constexpr,  # bytes per program (8 * BYTES elements)
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
    o = tl.load(out_ptr + eoff, mask=emask, other=0.0).to(tl.float32)
    tl.store(out_ptr + eoff, o + alpha * acc, mask=emask)


def onebit_decompress(bits: torch.Tensor, scales: torch.Tensor, chunk: int, out: torch.Tensor,
                      alpha: float = 1.0) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.onebit_decompress`. One pass over out."""
    check_flat(out, "out")
    _check_contiguous(bits, "bits")
    _check_contiguous(scales, "scales")
    n = out.numel()
    if chunk <= 0 or chunk % 8 or n % chunk:
        raise ValueError(f"need chunk % 8 == 0 and n % chunk == 0, got n={n}, chunk={chunk}")
    W, nchunks = bits.shape[0], n // chunk
    if tuple(bits.shape) != (W, n // 8) or tuple(scales.shape) != (W, 2, nchunks):
        raise ValueError(f"bits {tuple(bits.shape)} / scales {tuple(scales.shape)} do not match "
                         f"out of {n} elements in chunks of {chunk}")
    if n == 0 or W == 0:
        return out
    width = BLOCK // 8
    _onebit_decompress_kernel[(triton.cdiv(n // 8, width),)](
        bits, scales, out, n // 8, nchunks, chunk // 8, W, float(alpha),
        BYTES=width, num_warps=NUM_WARPS)
    return out


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
        # the segment's own stream, counted from its first element: the reference's
        # tl.rand(seeds[k], i - starts[k]), whatever the block size or the segment's place
        sd = tl.load(seeds_ptr + sid, mask=emask, other=0)
        ctr = eoff - tl.load(starts_ptr + sid, mask=emask, other=0)
        u = tl.rand(sd, ctr)
    else:
        u = tl.rand(seed, eoff)  # counter = element index: same stream whatever the block size
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
    """See :func:`gradcomp.kernels.reference.ternary_compress` (the same uniforms: ``tl.rand``
    is the reference's :func:`~gradcomp.kernels.reference.philox_uniform`). Reads 4n + 4n +
    8n (int64 seg), writes 4n + n/4."""
    check_flat(x)
    n = x.numel()
    if n % 4:
        raise ValueError(f"ternary_compress needs n % 4 == 0, got n={n}")
    check_flat(seg, "seg")
    _check_contiguous(scale, "scale")
    if seg.numel() != n:
        raise ValueError(f"seg has {seg.numel()} elements, x has {n}")
    if residual is not None:
        _check_fp32(residual, "residual", n)
    per_seg = isinstance(seed, torch.Tensor)
    if per_seg:
        if starts is None:
            raise ValueError("per-segment seeds need the segments' starts")
        for t, what in ((seed, "seed"), (starts, "starts")):
            check_flat(t, what)
            if t.dtype != torch.int64 or t.numel() != scale.numel():
                raise ValueError(f"{what} must be int64 with one entry per segment "
                                 f"({scale.numel()}), got {t.dtype} with {t.numel()}")
    out = _alloc((n // 4,), torch.uint8, x.device)
    if n == 0:
        return out
    width = BLOCK // 4
    res = residual if residual is not None else x
    seeds, first = (seed, starts) if per_seg else (seg, seg)  # unread without PER_SEG
    _ternary_compress_kernel[(triton.cdiv(n // 4, width),)](
        x, res, scale, seg, seeds, first, out, 0 if per_seg else int(seed) & _U64, n // 4,
        HAS_RES=residual is not None, PER_SEG=per_seg, BYTES=width, num_warps=NUM_WARPS)
    return out


@triton.jit
def _ternary_decompress_kernel(
    packed_ptr,  # (W, row) uint8 codes, row >= n/4 bytes per message   reads W n/4
    scale_ptr,   # (W, S) fp32 scalers                                  gathered (cached)
    seg_ptr,     # (n,) int32/int64 segment ids                         reads 8n (int64)
    out_ptr,     # (n,) accumulator, in place                           reads 4n, writes 4n
    n, row, S, W, alpha,
    BYTES: tl.constexpr,  # bytes per program (4 * BYTES elements)
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
    o = tl.load(out_ptr + eoff, mask=emask, other=0.0).to(tl.float32)
    tl.store(out_ptr + eoff, o + alpha * acc, mask=emask)


def ternary_decompress(packed: torch.Tensor, scale: torch.Tensor, seg: torch.Tensor,
                       out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.ternary_decompress`. One pass over out."""
    check_flat(out, "out")
    check_flat(seg, "seg")
    _check_contiguous(packed, "packed")
    _check_contiguous(scale, "scale")
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
    width = BLOCK // 4
    _ternary_decompress_kernel[(triton.cdiv(n, 4 * width),)](
        packed, scale, seg, out, n, row, scale.shape[1], W, float(alpha),
        BYTES=width, num_warps=NUM_WARPS)
    return out


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
    check_flat(x)
    n = x.numel()
    if not 0 <= k <= capacity:
        raise ValueError(f"need 0 <= k <= capacity, got k={k}, capacity={capacity}")
    if n >= 2**31:
        raise ValueError(f"indices are int32: x must have < 2^31 elements, got {n}")
    if not torch.is_tensor(threshold):
        threshold = torch.tensor(float(threshold), dtype=torch.float32, device=x.device)
    cand_val = _alloc((capacity,), torch.float32, x.device).zero_()
    cand_idx = _alloc((capacity,), torch.int32, x.device).zero_()
    if n and capacity:
        nblocks = triton.cdiv(n, BLOCK)
        counts = torch.empty(nblocks, dtype=torch.int32, device=x.device)
        _count_kernel[(nblocks,)](x, threshold, counts, n, BLOCK_=BLOCK, num_warps=NUM_WARPS)
        start = torch.cumsum(counts, 0, dtype=torch.int64) - counts  # exclusive scan, tiny
        _compact_kernel[(nblocks,)](x, threshold, start, cand_val, cand_idx, n, capacity,
                                    BLOCK_=BLOCK, num_warps=NUM_WARPS)
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
    check_flat(out, "out")
    _check_contiguous(values, "values")
    _check_contiguous(indices, "indices")
    m = values.numel()
    if indices.numel() != m:
        raise ValueError(f"values has {m} elements, indices {indices.numel()}")
    if m == 0:
        return out
    _scatter_add_kernel[(triton.cdiv(m, BLOCK),)](
        values.view(-1), indices.view(-1), out, m, out.numel(), float(alpha),
        BLOCK_=BLOCK, num_warps=NUM_WARPS)
    return out


# --------------------------------------------------------------------------- PowerSGD matrices
# Grouped matrix steps over a table of matrices of any shapes (see :mod:`.lowrank`, whose
# reference they match to float tolerance): one launch per step for a whole bucket. r is at
# most a few: the products are broadcast multiply-adds over a (rows, cols, R) tile, not
# tl.dot (no tf32, no minimum tile of 16 on the rank's side).
@triton.jit
def _psgd_tile(mats_ptr, tiles_ptr):
    """This program's tile: (its first row or column, then its matrix's table row)."""
    t = tl.program_id(0)
    row = mats_ptr + 6 * tl.load(tiles_ptr + 2 * t)
    return (tl.load(tiles_ptr + 2 * t + 1), tl.load(row), tl.load(row + 1), tl.load(row + 2),
            tl.load(row + 3), tl.load(row + 4), tl.load(row + 5))


@triton.jit
def _psgd_project_kernel(
    x_ptr,      # bucket, fp32/fp16/bf16                reads each matrix once
    q_ptr,      # Q's, fp32                             reads m r per row tile
    p_ptr,      # P's, fp32                             writes n r
    mats_ptr,   # (K, 6) int64 table
    tiles_ptr,  # (T, 2) int64 (matrix, first row)
    BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr,
):
    first, x_off, n, m, r, p_off, q_off = _psgd_tile(mats_ptr, tiles_ptr)
    rows = first + tl.arange(0, BN)
    js = tl.arange(0, R)
    rmask, jmask = rows < n, js < r
    acc = tl.zeros((BN, R), tl.float32)
    for c0 in range(0, m, BK):
        cols = c0 + tl.arange(0, BK)
        cmask = cols < m
        a = tl.load(x_ptr + x_off + rows[:, None] * m + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        b = tl.load(q_ptr + q_off + cols[:, None] * r + js[None, :],
                    mask=cmask[:, None] & jmask[None, :], other=0.0)
        acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    tl.store(p_ptr + p_off + rows[:, None] * r + js[None, :], acc,
             mask=rmask[:, None] & jmask[None, :])


@triton.jit
def _psgd_back_kernel(
    x_ptr,      # bucket                                reads each matrix once
    p_ptr,      # P's, fp32                             reads n r per column tile
    q_ptr,      # Q's, fp32                             writes m r
    mats_ptr, tiles_ptr,  # (U, 2) int64 (matrix, first column)
    BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr,
):
    first, x_off, n, m, r, p_off, q_off = _psgd_tile(mats_ptr, tiles_ptr)
    cols = first + tl.arange(0, BK)
    js = tl.arange(0, R)
    cmask, jmask = cols < m, js < r
    acc = tl.zeros((BK, R), tl.float32)
    for r0 in range(0, n, BN):
        rows = r0 + tl.arange(0, BN)
        rmask = rows < n
        a = tl.load(x_ptr + x_off + rows[:, None] * m + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        b = tl.load(p_ptr + p_off + rows[:, None] * r + js[None, :],
                    mask=rmask[:, None] & jmask[None, :], other=0.0)
        acc += tl.sum(a[:, :, None] * b[:, None, :], axis=0)
    tl.store(q_ptr + q_off + cols[:, None] * r + js[None, :], acc,
             mask=cmask[:, None] & jmask[None, :])


@triton.jit
def _psgd_expand_kernel(
    p_ptr, q_ptr,  # P's and Q's, fp32
    out_ptr,       # bucket: each matrix written once (in out's dtype)
    mats_ptr, tiles_ptr,  # row tiles, as project
    W,
    BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr,
):
    first, x_off, n, m, r, p_off, q_off = _psgd_tile(mats_ptr, tiles_ptr)
    rows = first + tl.arange(0, BN)
    js = tl.arange(0, R)
    rmask, jmask = rows < n, js < r
    a = tl.load(p_ptr + p_off + rows[:, None] * r + js[None, :],
                mask=rmask[:, None] & jmask[None, :], other=0.0)
    for c0 in range(0, m, BK):
        cols = c0 + tl.arange(0, BK)
        cmask = cols < m
        b = tl.load(q_ptr + q_off + cols[:, None] * r + js[None, :],
                    mask=cmask[:, None] & jmask[None, :], other=0.0)
        v = tl.sum(a[:, None, :] * b[None, :, :], axis=2) / W
        tl.store(out_ptr + x_off + rows[:, None] * m + cols[None, :],
                 v.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _psgd_orthonormalize_kernel(
    p_ptr,     # P's, fp32, in place: each read PASSES (r - 1) + 4 times per column
    mats_ptr,
    FALLBACK: tl.constexpr,
    BN: tl.constexpr, R: tl.constexpr, PASSES: tl.constexpr,
):
    row = mats_ptr + 6 * tl.program_id(0)
    n, r, p_off = tl.load(row + 1), tl.load(row + 3), tl.load(row + 4)
    js = tl.arange(0, R)
    jmask = js < r
    base = p_ptr + p_off
    for i in range(0, r):
        _psgd_unit_column(base, i, n, r, FALLBACK, BN, True)  # norm 1, plus the fallback
        for _ in range(0, PASSES):  # the projection, PASSES times (at i = 0 it is zero)
            dots = tl.zeros((R,), tl.float32)  # dots[j] = P[:, j] . P[:, i]
            for r0 in range(0, n, BN):
                rows = r0 + tl.arange(0, BN)
                blk = tl.load(base + rows[:, None] * r + js[None, :],
                              mask=(rows < n)[:, None] & jmask[None, :], other=0.0)
                col = tl.sum(tl.where(js[None, :] == i, blk, 0.0), axis=1)
                dots += tl.sum(blk * col[:, None], axis=0)
            dots = tl.where(js < i, dots, 0.0)
            tl.debug_barrier()
            for r0 in range(0, n, BN):
                rows = r0 + tl.arange(0, BN)
                rmask = rows < n
                blk = tl.load(base + rows[:, None] * r + js[None, :],
                              mask=rmask[:, None] & jmask[None, :], other=0.0)
                col = tl.sum(tl.where(js[None, :] == i, blk, 0.0), axis=1)
                tl.store(base + rows * r + i, col - tl.sum(blk * dots[None, :], axis=1),
                         mask=rmask)
            tl.debug_barrier()
        _psgd_unit_column(base, i, n, r, FALLBACK, BN, False)


@triton.jit
def _psgd_unit_column(base, i, n, r, FALLBACK: tl.constexpr, BN: tl.constexpr,
                      ADD: tl.constexpr):
    """Column i of an n x r P divided by its norm (clamped at 1e-30), plus (ADD) FALLBACK
    times :func:`gradcomp.kernels.lowrank.fallback_values`: its integer hash, whose low 16
    bits are the same at any integer width."""
    ss = tl.zeros((BN,), tl.float32)
    for r0 in range(0, n, BN):
        rows = r0 + tl.arange(0, BN)
        col = tl.load(base + rows * r + i, mask=rows < n, other=0.0)
        ss += col * col
    norm = tl.maximum(tl.sqrt(tl.sum(ss, axis=0)), 1e-30)
    for r0 in range(0, n, BN):
        rows = r0 + tl.arange(0, BN)
        col = tl.load(base + rows * r + i, mask=rows < n, other=0.0) / norm
        if ADD:
            h = ((rows.to(tl.int64) + 1) * 2654435761 + (i + 1) * 2246822519) & 65535
            col += FALLBACK * (h.to(tl.float32) / 65536.0 - 0.5)
        tl.store(base + rows * r + i, col, mask=rows < n)
    tl.debug_barrier()


def _check_table(table, *ts):
    for t in ts:
        check_flat(t, "buffer")
    if table.mats.device != ts[0].device:
        raise ValueError(f"the matrix table is on {table.mats.device}, the buffers on "
                         f"{ts[0].device}")


def powersgd_project(x, q, p, table):
    """See :func:`gradcomp.kernels.lowrank.project`: one launch."""
    _check_table(table, x, q, p)
    if table.rows:
        from .lowrank import TILE_COLS, TILE_ROWS
        _psgd_project_kernel[(table.row_tiles.shape[0],)](
            x, q, p, table.mats, table.row_tiles, BN=TILE_ROWS, BK=TILE_COLS, R=table.rank,
            num_warps=NUM_WARPS)
    return p


def powersgd_back(x, p, q, table):
    """See :func:`gradcomp.kernels.lowrank.back`: one launch."""
    _check_table(table, x, p, q)
    if table.rows:
        from .lowrank import TILE_COLS, TILE_ROWS
        _psgd_back_kernel[(table.col_tiles.shape[0],)](
            x, p, q, table.mats, table.col_tiles, BN=TILE_ROWS, BK=TILE_COLS, R=table.rank,
            num_warps=NUM_WARPS)
    return q


def powersgd_expand(p, q, out, table, W):
    """See :func:`gradcomp.kernels.lowrank.expand`: one launch."""
    _check_table(table, p, q, out)
    if table.rows:
        from .lowrank import TILE_COLS, TILE_ROWS
        _psgd_expand_kernel[(table.row_tiles.shape[0],)](
            p, q, out, table.mats, table.row_tiles, float(W), BN=TILE_ROWS, BK=TILE_COLS,
            R=table.rank, num_warps=NUM_WARPS)
    return out


def powersgd_orthonormalize(p, table, passes, fallback):
    """See :func:`gradcomp.kernels.lowrank.orthonormalize`: one launch, a program per
    matrix."""
    _check_table(table, p)
    if table.rows:
        from .lowrank import TILE_ROWS
        _psgd_orthonormalize_kernel[(len(table.rows),)](
            p, table.mats, fallback, BN=4 * TILE_ROWS, R=table.rank, PASSES=passes,
            num_warps=NUM_WARPS)
    return p


# --------------------------------------------------------------------------- segmented candidates
# Step 3 of the segmented top-k (kernels/segmented.py, ``select_above``): the first cap_p
# elements with |x| >= thr of each segment, in index order, into the segment's candidate
# slots. Three launches and a cumsum over the tiny per-block counts, where the torch path
# takes ~20 ops; the same slots as its "cumsum" way.
@triton.jit
def _seg_count_kernel(
    x_ptr,       # (n,) x                                reads 4n
    thr_ptr,     # (S,) fp32 threshold per segment (NaN: no candidate)
    seg_ptr,     # (n,) int32 segment of each element    reads 4n
    counts_ptr,  # (nblocks,) int32 candidates per block
    n,
    BLOCK_: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(thr_ptr + tl.load(seg_ptr + offs, mask=mask, other=0), mask=mask, other=0.0)
    hit = (tl.abs(x) >= t) & mask
    tl.store(counts_ptr + pid, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _seg_before_kernel(
    x_ptr, thr_ptr, seg_ptr,
    start_ptr,   # (nblocks,) int64 candidates before each block
    first_ptr,   # (S,) int64 first element of each segment
    before_ptr,  # (S,) int64 out: candidates before each segment
    BLOCK_: tl.constexpr,
):
    s = tl.program_id(0)
    first = tl.load(first_ptr + s)
    prev = tl.maximum(first - 1, 0)
    b = prev // BLOCK_
    offs = b * BLOCK_ + tl.arange(0, BLOCK_)
    mask = offs <= prev
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(thr_ptr + tl.load(seg_ptr + offs, mask=mask, other=0), mask=mask, other=0.0)
    hit = (tl.abs(x) >= t) & mask
    cnt = tl.load(start_ptr + b) + tl.sum(hit.to(tl.int64), axis=0)
    tl.store(before_ptr + s, tl.where(first == 0, 0, cnt))


@triton.jit
def _seg_compact_kernel(
    x_ptr, thr_ptr, seg_ptr,
    start_ptr,      # (nblocks,) int64 candidates before each block
    before_ptr,     # (S,) int64 candidates before each segment
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
    xv = tl.load(x_ptr + offs, mask=mask, other=0.0)
    seg = tl.load(seg_ptr + offs, mask=mask, other=0)
    t = tl.load(thr_ptr + seg, mask=mask, other=0.0)
    hit = (tl.abs(xv.to(tl.float32)) >= t) & mask
    cand = tl.load(start_ptr + pid) + tl.cumsum(hit.to(tl.int64), axis=0)  # inclusive
    slot = cand - 1 - tl.load(before_ptr + seg, mask=mask, other=0) \
        + tl.load(slot_base_ptr + seg, mask=mask, other=0)
    keep = hit & (slot < tl.load(slot_end_ptr + seg, mask=mask, other=0))
    tl.store(val_ptr + slot, xv, mask=keep)
    tl.store(idx_ptr + slot, offs, mask=keep)


def segment_candidates(x: torch.Tensor, thr: torch.Tensor, seg_of: torch.Tensor,
                       seg_start: torch.Tensor, slot_base: torch.Tensor, slot_end: torch.Tensor,
                       slots: int):
    """(values (C + 1,) in x's dtype, int64 indices (C + 1,)): for each segment s, the first
    slot_end[s] - slot_base[s] elements of x with |x| >= thr[s] (NaN: none), in index order,
    at slots slot_base[s]...; the others hold 0 (slot C, the torch path's spill slot, too).
    The slots of :func:`gradcomp.kernels.segmented.select_above`'s "cumsum" way."""
    check_flat(x)
    n = x.numel()
    val = _alloc((slots + 1,), x.dtype, x.device).zero_()
    idx = _alloc((slots + 1,), torch.int64, x.device).zero_()
    if n == 0 or slots == 0:
        return val, idx
    nblocks = triton.cdiv(n, BLOCK)
    counts = torch.empty(nblocks, dtype=torch.int32, device=x.device)
    _seg_count_kernel[(nblocks,)](x, thr, seg_of, counts, n, BLOCK_=BLOCK, num_warps=NUM_WARPS)
    start = torch.cumsum(counts, 0, dtype=torch.int64) - counts  # exclusive scan, tiny
    before = torch.empty(seg_start.numel(), dtype=torch.int64, device=x.device)
    _seg_before_kernel[(seg_start.numel(),)](x, thr, seg_of, start, seg_start, before,
                                             BLOCK_=BLOCK, num_warps=NUM_WARPS)
    _seg_compact_kernel[(nblocks,)](x, thr, seg_of, start, before, slot_base, slot_end, val, idx,
                                    n, BLOCK_=BLOCK, num_warps=NUM_WARPS)
    return val, idx


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
    sent = _alloc((P,), torch.float32, guard.device)
    thr = guard.clone()
    if P:
        adaptive = taus is not None
        _threshold_tau_kernel[(triton.cdiv(P, 1024),)](
            mag, nonzero_end if adaptive else est_start, est_start, est_end,
            taus if adaptive else sent, where, guard, param_seg, sent, thr, P,
            float(fixed or 0.0), float(1 - ema), ADAPTIVE=adaptive, BLOCK_=1024,
            num_warps=NUM_WARPS)
    return sent, thr


@triton.jit
def _threshold_encode_kernel(
    val_ptr,    # (K,) selected values (0: unused slot)
    idx_ptr,    # (K,) int64 their indices
    owner_ptr,  # (K,) int64 parameter of each slot
    tau_ptr,    # (P,) fp32
    code_ptr,   # (K,) int32 out
    res_ptr,    # (n,) fp32 residual (a copy of x), in place at the sent indices (if HAS_RES)
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


def threshold_encode(x, vals, idx, owner, tau, residual):
    """See :func:`gradcomp.kernels.reference.threshold_encode`: a copy and one launch."""
    K = vals.numel()
    codes = _alloc((K,), torch.int32, vals.device)
    if residual is not None:
        residual.copy_(x)
    if K:
        _threshold_encode_kernel[(triton.cdiv(K, BLOCK),)](
            vals, idx, owner, tau, codes, residual if residual is not None else vals, K,
            HAS_RES=residual is not None, BLOCK_=BLOCK, num_warps=NUM_WARPS)
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
    check_flat(out, "out")
    _check_contiguous(got, "got")
    if K and got.shape[0]:
        _threshold_decode_kernel[(triton.cdiv(K, BLOCK),)](
            got, owner, out, got.shape[1], K, got.shape[0], BLOCK_=BLOCK, num_warps=NUM_WARPS)
    return out
