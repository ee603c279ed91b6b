"""TernGrad's Triton kernels (compressors/terngrad.py): ternary_compress and
ternary_decompress, as kernels/reference.py specifies them (see kernels/triton/__init__.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common as c
from .. import reference
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


# ------------------------------------------------ TernGrad's bucket path: stats, encode, decode
@triton.jit
def _ternary_partials_kernel(
    x_ptr,      # (n,) x, fp32/fp16/bf16                           reads 4n
    xoff_ptr,   # (S,) int64 first element of each segment in x
    numel_ptr,  # (S,) int64 elements of each segment in x
    cseg_ptr,   # (C,) int32 segment of each chunk
    c0_ptr,     # (S,) int64 first chunk of each segment
    part_ptr,   # (3, C) fp32 out: each chunk's max |y|, sum, sum of squares    writes 12C
    C,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0)
    k = tl.load(cseg_ptr + c)
    lo = (c - tl.load(c0_ptr + k)).to(tl.int64) * CHUNK
    m = tl.minimum(tl.load(numel_ptr + k) - lo, CHUNK)
    base = x_ptr + tl.load(xoff_ptr + k) + lo
    lane = tl.arange(0, BLOCK)
    top = tl.zeros((BLOCK,), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    total_sq = tl.zeros((BLOCK,), tl.float32)
    for at in range(0, m, BLOCK):
        i = at + lane
        y = tl.load(base + i, mask=i < m, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.abs(y))
        total += y
        total_sq += y * y
    tl.store(part_ptr + c, tl.max(top, axis=0))
    tl.store(part_ptr + C + c, tl.sum(total, axis=0))
    tl.store(part_ptr + 2 * C + c, tl.sum(total_sq, axis=0))


@triton.jit
def _ternary_stats_kernel(
    part_ptr,   # (3, C) fp32 the chunks' max |y|, sums and sums of squares    reads 12C
    c0_ptr,     # (S + 1,) int64 first chunk of each segment (then C)
    len_ptr,    # (S,) int64 padded length of each segment (the divisor of its means)
    scale_ptr,  # (S,) fp32 out: min(max |y|, bound) (max |y| without CLIP)   writes 4S
    bound_ptr,  # (S,) fp32 out: clip * sigma                                  writes 4S
    clip, C,
    CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    k = tl.program_id(0)
    first = tl.load(c0_ptr + k)
    m = tl.load(c0_ptr + k + 1) - first
    lane = tl.arange(0, BLOCK)
    top = tl.zeros((BLOCK,), tl.float32)
    total = tl.zeros((BLOCK,), tl.float32)
    total_sq = tl.zeros((BLOCK,), tl.float32)
    for at in range(0, m, BLOCK):
        i = at + lane
        on = i < m
        top = tl.maximum(top, tl.load(part_ptr + first + i, mask=on, other=0.0))
        total += tl.load(part_ptr + C + first + i, mask=on, other=0.0)
        total_sq += tl.load(part_ptr + 2 * C + first + i, mask=on, other=0.0)
    t = tl.max(top, axis=0)
    if CLIP:
        L = tl.load(len_ptr + k).to(tl.float32)
        mean = tl.div_rn(tl.sum(total, axis=0), L)
        var = tl.div_rn(tl.sum(total_sq, axis=0), L) - mean * mean
        b = tl.sqrt_rn(tl.maximum(var, 0.0, propagate_nan=tl.PropagateNan.ALL)) * clip
        tl.store(bound_ptr + k, b)
        t = tl.minimum(t, b, propagate_nan=tl.PropagateNan.ALL)  # as torch.minimum
    tl.store(scale_ptr + k, t)


def ternary_stats(x: torch.Tensor, xoff: torch.Tensor, numel: torch.Tensor,
                  lengths: torch.Tensor, clip: float,
                  chunks: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`gradcomp.kernels.reference.ternary_stats`: two launches, one program per
    chunk of :data:`~gradcomp.kernels.reference.STATS_CHUNK` elements (its max |y| and fp32
    sums: a lane per element of a block, then the lanes' tree sum), then one per segment over
    its chunks' partials in the same way. ``chunks``:
    :func:`~gradcomp.kernels.reference.stats_chunks` of the segments (made here when not
    given). Reads 4n, writes 12 C + 8S."""
    c.check_flat(x)
    for t, what in ((xoff, "xoff"), (numel, "numel"), (lengths, "lengths")):
        c.check_flat(t, what)
        if t.dtype != torch.int64 or t.numel() != xoff.numel():
            raise ValueError(f"{what} must be int64 with one entry per segment "
                             f"({xoff.numel()}), got {t.dtype} with {t.numel()}")
    S = xoff.numel()
    if chunks is None:
        chunks = reference.stats_chunks(numel.tolist(), x.device)
    cseg, c0 = chunks
    C = cseg.numel()
    scale = c.alloc((S,), torch.float32, x.device)
    bound = c.alloc((S,), torch.float32, x.device)
    if S:
        part = c.alloc((3, C), torch.float32, x.device)
        chunk = reference.STATS_CHUNK
        _ternary_partials_kernel[(C,)](x, xoff, numel, cseg, c0, part, C, CHUNK=chunk,
                                       BLOCK=min(c.BLOCK, chunk), num_warps=c.NUM_WARPS)
        _ternary_stats_kernel[(S,)](part, c0, lengths, scale, bound, float(clip), C,
                                    CLIP=bool(clip), BLOCK=c.BLOCK, num_warps=c.NUM_WARPS)
    return scale, bound


@triton.jit
def _ternary_encode_kernel(
    src_ptr,    # the values, fp32/fp16/bf16                        reads 4 npad
    soff_ptr,   # (S,) int64 where each segment starts in src
    snum_ptr,   # (S,) int64 values of each segment in src (zeros past them)
    scale_ptr,  # (S,) fp32 per-segment scaler                     gathered (cached)
    bound_ptr,  # (S,) fp32 per-segment clip bound (if CLAMP)      gathered (cached)
    seg_ptr,    # (npad,) int32/int64 segment of each padded element   reads 4 npad (int32)
    seeds_ptr,  # (S,) int64 per-segment seed
    starts_ptr, # (S,) int64 first padded element of each segment
    out_ptr,    # ((npad + 4) // 5,) uint8 codes, five a byte in base 3    writes npad / 5
    x_ptr,      # the dense values' source (programs past ``code_programs``)  reads 4D
    dpos_ptr,   # (D,) int64 each dense value's place in x                 reads 8D
    dout_ptr,   # (D,) fp32 the dense values                               writes 4D
    npad, nbytes, code_programs, ndense,
    CLAMP: tl.constexpr,
    BYTES: tl.constexpr,  # bytes per program (5 * BYTES elements)
    DENSE: tl.constexpr,  # dense values per program
):
    pid = tl.program_id(0)
    if pid >= code_programs:
        d = (pid - code_programs).to(tl.int64) * DENSE + tl.arange(0, DENSE)
        dm = d < ndense
        pos = tl.load(dpos_ptr + d, mask=dm, other=0)
        tl.store(dout_ptr + d, tl.load(x_ptr + pos, mask=dm, other=0.0), mask=dm)
        return
    byte = pid.to(tl.int64) * BYTES + tl.arange(0, BYTES)
    sub = tl.arange(0, 8)  # a byte's five places (three lanes unused)
    e = byte[:, None] * 5 + sub[None, :]
    emask = (byte[:, None] < nbytes) & (sub[None, :] < 5) & (e < npad)
    k = tl.load(seg_ptr + e, mask=emask, other=0)
    j = e - tl.load(starts_ptr + k, mask=emask, other=0)
    inside = emask & (j < tl.load(snum_ptr + k, mask=emask, other=0))
    y = tl.load(src_ptr + tl.load(soff_ptr + k, mask=inside, other=0) + j, mask=inside,
                other=0.0).to(tl.float32)
    if CLAMP:
        b = tl.load(bound_ptr + k, mask=emask, other=0.0)
        y = tl.minimum(tl.maximum(y, -b), b)
    s = tl.load(scale_ptr + k, mask=emask, other=0.0)
    sd = tl.load(seeds_ptr + k, mask=emask, other=0)
    # element j of a segment draws word j % 4 of Philox at counter j // 4 (as ternary_compress)
    u0, u1, u2, u3 = tl.rand4x(sd, j >> 2)
    w = j & 3
    u = tl.where(w == 0, u0, tl.where(w == 1, u1, tl.where(w == 2, u2, u3)))
    keep = emask & (u * s < tl.abs(y))
    code = tl.where(keep, tl.where(y >= 0, 1, 2), 0)
    weight = tl.where(sub == 0, 1, tl.where(sub == 1, 3, tl.where(sub == 2, 9,
                      tl.where(sub == 3, 27, tl.where(sub == 4, 81, 0)))))
    packed = tl.sum(code * weight[None, :], axis=1)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)


def ternary_encode(src: torch.Tensor, soff: torch.Tensor, snum: torch.Tensor,
                   scale: torch.Tensor, bound: torch.Tensor | None, seg: torch.Tensor,
                   seeds: torch.Tensor, starts: torch.Tensor, out: torch.Tensor,
                   x: torch.Tensor | None = None, dense_pos: torch.Tensor | None = None,
                   dense_out: torch.Tensor | None = None) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.ternary_encode` (the same uniforms as
    :func:`ternary_compress`). One kernel, the dense values' gather in programs of its own;
    reads 4 npad + 4 npad (int32 seg) + 12 D, writes npad / 5 + 4 D."""
    c.check_flat(src, "src")
    c.check_flat(seg, "seg")
    c.check_flat(out, "out")
    npad = seg.numel()
    if npad % 4:
        raise ValueError(f"ternary_encode needs npad % 4 == 0, got {npad}")
    S = scale.numel()
    for t, what in ((soff, "soff"), (snum, "snum"), (seeds, "seeds"), (starts, "starts")):
        c.check_flat(t, what)
        if t.dtype != torch.int64 or t.numel() != S:
            raise ValueError(f"{what} must be int64 with one entry per segment ({S}), got "
                             f"{t.dtype} with {t.numel()}")
    c.check_contiguous(scale, "scale")
    nbytes = (npad + 4) // 5
    if out.dtype != torch.uint8 or out.numel() != nbytes:
        raise ValueError(f"out must be uint8 with {nbytes} bytes, got {out.dtype} with "
                         f"{out.numel()}")
    D = 0 if dense_pos is None else dense_pos.numel()
    if D:
        c.check_flat(dense_pos, "dense_pos")
        c.check_fp32(dense_out, "dense_out", D)
        c.check_flat(x, "x")
        if dense_pos.dtype != torch.int64:
            raise ValueError(f"dense_pos must be int64, got {dense_pos.dtype}")
    width = c.BLOCK // 8
    programs = triton.cdiv(nbytes, width)
    if programs + D == 0:
        return out
    _ternary_encode_kernel[(programs + triton.cdiv(D, c.BLOCK),)](
        src, soff, snum, scale, bound if bound is not None else scale, seg, seeds, starts, out,
        x if D else src, dense_pos if D else soff, dense_out if D else scale, npad, nbytes,
        programs, D, CLAMP=bound is not None, BYTES=width, DENSE=c.BLOCK,
        num_warps=c.NUM_WARPS)
    return out


@triton.jit
def _ternary_decode_kernel(
    codes_ptr,   # (W, row) uint8 base-3 codes, rows ``code_row`` apart    reads W npad / 5
    scale_ptr,   # (W, S) fp32 scalers, rows ``scale_row`` apart (0: shared)   gathered
    dense_ptr,   # (W, D) fp32 dense values, rows ``dense_row`` apart        reads 4 W D
    xseg_ptr,    # (n,) int32 entry of each element of out (-1: none)     reads 4n
    xoff_ptr,    # (P,) int64 where each entry starts in out
    src_ptr,     # (P,) int64 its first code (k < S) or dense value (k >= S)
    out_ptr,     # (n,) written, not read                                 writes 4n
    flag_ptr,    # fp32, the guard's flag: out NaN throughout where [0] > 0 (HAS_FLAG)
    clear_ptr,   # fp32, the guard's other flag: [0] = 0 by program 0 (HAS_FLAG)
    n, S, W, code_row, scale_row, dense_row, alpha, ranks,  # ranks: W as fp32
    HAS_FLAG: tl.constexpr, BLOCK: tl.constexpr,
):
    if HAS_FLAG:
        if tl.program_id(0) == 0:
            tl.store(clear_ptr, 0.0)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    k = tl.load(xseg_ptr + i, mask=mask, other=-1)
    some = mask & (k >= 0)
    comp = some & (k < S)
    dn = some & (k >= S)
    at = tl.load(src_ptr + k, mask=some, other=0) + i - tl.load(xoff_ptr + k, mask=some, other=0)
    byte = at // 5
    place = at - byte * 5
    weight = tl.where(place == 0, 1, tl.where(place == 1, 3, tl.where(place == 2, 9,
                      tl.where(place == 3, 27, 81))))
    acc = tl.zeros((BLOCK,), tl.float32)
    cp = codes_ptr + byte
    sp = scale_ptr + k
    for _ in range(W):
        code = (tl.load(cp, mask=comp, other=0).to(tl.int32) // weight) % 3
        s = tl.load(sp, mask=comp, other=0.0)
        acc += tl.where(code == 1, s, tl.where(code == 2, -s, 0.0))
        cp += code_row
        sp += scale_row
    v = alpha * acc
    v = tl.where(v == 0.0, 0.0, v)
    dp = dense_ptr + at
    total = tl.load(dp, mask=dn, other=0.0)
    for _ in range(1, W):
        dp += dense_row
        total += tl.load(dp, mask=dn, other=0.0)
    v = tl.where(dn, tl.div_rn(total, ranks), v)
    v = tl.where(some, v, 0.0)
    if HAS_FLAG:
        v = tl.where(tl.load(flag_ptr) > 0, float("nan"), v)
    tl.store(out_ptr + i, v, mask=mask)


def ternary_decode(codes: torch.Tensor, scales: torch.Tensor, dense: torch.Tensor | None,
                   xseg: torch.Tensor, xoff: torch.Tensor, src: torch.Tensor, S: int,
                   out: torch.Tensor, alpha: float, verdict=None) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.ternary_decode`. One kernel: out written once,
    each message read once; the rows of ``codes``, ``scales`` and ``dense`` may lie any
    distance apart (views of the gathered messages; a scales row stride of 0: one set
    shared by every rank)."""
    c.check_flat(out, "out")
    c.check_flat(xseg, "xseg")
    n = out.numel()
    if xseg.numel() != n or xseg.dtype != torch.int32:
        raise ValueError(f"xseg must be int32 with {n} elements, got {xseg.dtype} with "
                         f"{xseg.numel()}")
    W = codes.shape[0]
    for t, what in ((codes, "codes"), (scales, "scales"), (dense, "dense")):
        if t is not None and (t.dim() != 2 or t.shape[0] != W or (t.shape[1] > 1
                                                                  and t.stride(1) != 1)):
            raise ValueError(f"{what} must be (W, m) rows of contiguous values, got shape "
                             f"{tuple(t.shape)} with strides {t.stride()}")
    if scales.shape[1] != S:
        raise ValueError(f"scales must have {S} columns, got {scales.shape[1]}")
    flag, clear = (out, out) if verdict is None else verdict
    if verdict is not None:
        reference.check_guard(out, flag, x_name="out")
        reference.check_clear(flag, clear)
    if (n == 0 or W == 0) and verdict is None:
        return out
    has_dense = dense is not None and dense.shape[1] > 0
    d = dense if has_dense else scales
    _ternary_decode_kernel[(max(triton.cdiv(n, c.BLOCK), 1),)](
        codes, scales, d, xseg, xoff, src, out, flag, clear, n, S, W, codes.stride(0),
        scales.stride(0), d.stride(0) if has_dense else 0, float(alpha), float(W),
        HAS_FLAG=verdict is not None, BLOCK=c.BLOCK, num_warps=c.NUM_WARPS)
    return out
