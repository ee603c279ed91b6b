"""The CPU path of the 1-bit steps and TernGrad's decoder: the reference's arithmetic, block
by block.

The reference (:mod:`.reference`) is written for clarity: each step is one torch op over the
whole bucket, so a bucket larger than the caches is read from memory once per op, and its
``torch.where`` over a bool mask (the dequantization) is a slow, unvectorized op on the CPU.
Here the same steps run over blocks of whole chunks small enough to stay in the caches
(``BLOCK`` elements), with the 1-bit selection written as float arithmetic that is exact:
with h in {0, 1}, ``h * hi + (1 - h) * lo`` is exactly ``hi`` or ``lo`` (one product is an
exact zero), and bits and ternary codes unpacked by a table of floats. The results are
**bit-identical** to the reference (tested), so the reference stays the specification and a
run resumes exactly whichever path wrote its state.

Still pure torch (no native code), which bounds the gain: every op is a pass over a block,
and unpacking bits costs a table lookup per byte. Below ``MIN_NUMEL`` elements the
reference is as fast (its temporaries fit the caches) and runs instead. TernGrad's encoder
has no blocked version: its time goes to drawing the uniforms (the Philox stream,
:func:`reference.ternary_uniforms`, ~70 int64 passes), which blocking does not change;
:mod:`.compiled` fuses it into one pass where a C++ compiler is present (bit-identical).
See bench/RESULTS.md, section 6.
"""
from __future__ import annotations

import functools

import torch

from . import reference
from .reference import PACK8, check_flat

BLOCK = 1 << 18  # elements per block: ~1 MB per fp32 temporary, within this L2 + L3
MIN_NUMEL = 1 << 17  # 1-bit steps on fewer elements run the reference


def _fp32(*ts) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in ts)


def _onebit_blocks(n: int, chunk: int) -> bool:
    """Whether the blocked 1-bit path takes n elements: whole chunks, and enough of them."""
    return n >= max(MIN_NUMEL, 2 * chunk) and n % chunk == 0


def _chunks_per_block(chunk: int) -> int:
    return max(1, BLOCK // chunk)


def onebit_compress(x: torch.Tensor, residual: torch.Tensor | None, chunk: int):
    """:func:`reference.onebit_compress`, block by block. Same arguments, same results."""
    check_flat(x)
    if not _fp32(x, residual) or not _onebit_blocks(x.numel(), chunk):
        return reference.onebit_compress(x, residual, chunk)
    n = x.numel()
    C = n // chunk
    y = residual.add_(x) if residual is not None else x  # x + r == r + x exactly
    bits = torch.empty(n // 8, dtype=torch.uint8)
    scales = torch.empty(2, C)
    cb = _chunks_per_block(chunk)
    h = torch.empty(cb * chunk)
    parts = torch.empty(2, cb * chunk)  # each chunk's non-negative and negative parts
    pos = torch.empty(cb * chunk, dtype=torch.bool)
    words = torch.empty(cb * chunk // 8, dtype=torch.int64)
    for c0 in range(0, C, cb):
        c1 = min(C, c0 + cb)
        m = (c1 - c0) * chunk
        yb = y[c0 * chunk : c0 * chunk + m].view(c1 - c0, chunk)
        hb = h[:m].view(c1 - c0, chunk)
        pn = parts[:, :m].view(2, c1 - c0, chunk)
        torch.clamp(yb, min=0.0, out=pn[0])
        torch.clamp(yb, max=0.0, out=pn[1])
        psum, nsum = _row_sums_(pn)
        torch.ge(yb, 0, out=hb)  # h = 1.0 where y >= 0, else 0.0
        npos = hb.sum(dim=1)  # exact: integers below 2^24
        hi = psum / npos.clamp_min(1)
        lo = nsum / (chunk - npos).clamp_min(1)
        scales[0, c0:c1] = hi
        scales[1, c0:c1] = lo
        pb = pos[:m]
        _pack_block(yb.view(-1), pb, words, bits[c0 * chunk // 8 : (c0 * chunk + m) // 8])
        if residual is not None:
            if torch.isfinite(hi).all() and torch.isfinite(lo).all():
                _sub_dequant(yb, hb, hi, lo)
            else:  # 0 * inf is NaN: the reference's selection for this block
                yb.sub_(reference.dequant(pb.view(c1 - c0, chunk), hi, lo))
    return bits, scales


def _row_sums_(t: torch.Tensor) -> torch.Tensor:
    """:func:`reference.row_sums` of t (..., w) in place (t's rows are overwritten): the same
    adds in the same order, without the halves' temporaries."""
    w = t.shape[-1]
    while w > 1:
        h = (w + 1) // 2
        t[..., : w - h].add_(t[..., h:w])  # disjoint: w - h <= h
        w = h
    return t[..., 0]


def _pack_block(y: torch.Tensor, pos: torch.Tensor, words: torch.Tensor, out: torch.Tensor) -> None:
    """out (m / 8 bytes) = the signs of y (m elements; bit set where y >= 0, LSB first), with
    pos (m bools) and words (m / 8 int64) as work space. The test as bools, packed eight at
    a time by one int64 product (reference.PACK8): cheaper than converting floats (bool <->
    float conversions are slow, unvectorized CPU ops)."""
    torch.ge(y, 0, out=pos)
    w = words[: y.numel() // 8]
    torch.mul(pos.view(torch.int64), PACK8, out=w)
    out.copy_(w.bitwise_right_shift_(56))


def pack_signs(y: torch.Tensor) -> torch.Tensor:
    """The packed signs of y (n elements, n a multiple of 8) as :func:`reference.pack_bits`
    gives them for ``y >= 0``: block by block, in the caches (20 against 21 ms whole for
    11M elements on one thread)."""
    y = y.reshape(-1)
    n = y.numel()
    bits = torch.empty(n // 8, dtype=torch.uint8, device=y.device)
    m = min(n, BLOCK)
    pos = torch.empty(m, dtype=torch.bool)
    words = torch.empty(m // 8, dtype=torch.int64)
    for a in range(0, n, BLOCK):
        b = min(n, a + BLOCK)
        _pack_block(y[a:b], pos[: b - a], words, bits[a // 8 : b // 8])
    return bits


def _sub_dequant(y: torch.Tensor, h: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """y -= where(h == 1, hi, lo) per row, exactly (finite hi, lo); h is overwritten."""
    y.addcmul_(h, hi.unsqueeze(1), value=-1.0)  # y - hi where h = 1, y - 0 where h = 0
    h.neg_().add_(1.0)
    y.addcmul_(h, lo.unsqueeze(1), value=-1.0)


@functools.cache
def _bit_table() -> torch.Tensor:
    """float per bit, eight bits per byte, LSB first."""
    v = torch.arange(256).unsqueeze(1)
    return ((v >> torch.arange(8)) & 1).to(torch.float32)


def put_decoded(out: torch.Tensor, total: torch.Tensor, alpha: float, accumulate: bool) -> None:
    """out += alpha * total, or (accumulate=False) out = what that gives on a zero out, bit
    for bit, without reading out: alpha * total + 0.0 (one rounding, as the add's; the + 0.0
    turns -0.0 into +0.0 as 0 + (-0.0) does)."""
    if accumulate:
        out.add_(total, alpha=alpha)
    else:
        torch.mul(total, alpha, out=out).add_(0.0)


def onebit_decompress(bits: torch.Tensor, scales: torch.Tensor, chunk: int, out: torch.Tensor,
                      alpha: float = 1.0, accumulate: bool = True) -> torch.Tensor:
    """:func:`reference.onebit_decompress`, block by block. Same arguments, same results;
    ``accumulate=False``: out's values are not read, the result is that of a zero out."""
    W = bits.shape[0]
    n = out.numel()
    if not _fp32(out, scales) or not _onebit_blocks(n, chunk) or not out.is_contiguous() or W == 0:
        if not accumulate:
            out.zero_()
        return reference.onebit_decompress(bits, scales, chunk, out, alpha)
    C = n // chunk
    table = _bit_table()
    cb = _chunks_per_block(chunk)
    h = torch.empty(cb * chunk)
    deq = torch.empty(cb * chunk)
    acc = torch.empty(cb * chunk)
    finite = bool(torch.isfinite(scales).all())
    for c0 in range(0, C, cb):
        c1 = min(C, c0 + cb)
        m = (c1 - c0) * chunk
        b0, b1 = c0 * chunk // 8, (c0 * chunk + m) // 8
        ab = acc[:m].view(c1 - c0, chunk)
        for w in range(W):
            hi, lo = scales[w, 0, c0:c1], scales[w, 1, c0:c1]
            target = ab if w == 0 else deq[:m].view(c1 - c0, chunk)
            if finite:
                hb = h[:m].view(c1 - c0, chunk)
                torch.index_select(table, 0, bits[w, b0:b1].long(), out=hb.view(-1, 8))
                torch.mul(hb, hi.unsqueeze(1), out=target)  # hi where the bit is set, else 0
                hb.neg_().add_(1.0)
                target.addcmul_(hb, lo.unsqueeze(1))  # + lo where it is not, else + 0
            else:  # 0 * inf is NaN: the reference's selection
                pos = reference.unpack_bits(bits[w, b0:b1]).view(c1 - c0, chunk)
                target.copy_(reference.dequant(pos, hi, lo))
            if w > 0:
                ab.add_(target)
        put_decoded(out[c0 * chunk : c0 * chunk + m].view(c1 - c0, chunk), ab, alpha, accumulate)
    return out


# --------------------------------------------------------------------------- TernGrad
@functools.cache
def _code_table() -> torch.Tensor:
    """float per 2-bit code, four codes per byte, LSB first: 1 -> +1, 2 -> -1, 0 and 3 -> 0
    (the reference's ``(codes == 1).float() - (codes == 2).float()``)."""
    codes = (torch.arange(256).unsqueeze(1) >> (2 * torch.arange(4))) & 3
    return (codes == 1).float() - (codes == 2).float()


def ternary_decompress(packed: torch.Tensor, scale: torch.Tensor, seg: torch.Tensor,
                       out: torch.Tensor, alpha: float = 1.0, accumulate: bool = True
                       ) -> torch.Tensor:
    """:func:`reference.ternary_decompress`, block by block. Same arguments, same results;
    ``accumulate=False``: out's values are not read, the result is that of a zero out."""
    W, n = packed.shape[0], out.numel()
    if not _fp32(out, scale) or n < 8 or n % 4 or not out.is_contiguous() or W == 0:
        if not accumulate:
            out.zero_()
        return reference.ternary_decompress(packed, scale, seg, out, alpha)
    table = _code_table()
    one = scale.shape[1] == 1
    B = min(n, max(4, BLOCK // 4 * 4))
    terms = torch.empty(W, B)
    total = torch.empty(B)
    for e0 in range(0, n, B):
        m = min(B, n - e0)
        tb = terms[:, :m]
        segb = None if one else seg[e0 : e0 + m]
        for w in range(W):
            row = tb[w]
            codes = packed[w, e0 // 4 : (e0 + m) // 4].long()
            torch.index_select(table, 0, codes, out=row.view(-1, 4))
            row.mul_(scale[w] if one else scale[w].index_select(0, segb))
        torch.sum(tb, dim=0, out=total[:m])
        put_decoded(out[e0 : e0 + m], total[:m], alpha, accumulate)
    return out
