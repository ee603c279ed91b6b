"""Rows of per-parameter chunks in a few bits, and their average over ranks: DiLoCo's
pseudo-gradient (compressors/diloco.py) and the int8 dense warm-up (``dense_wire="int8"``,
:func:`dense_rows`).

A row is ``chunk`` elements of one parameter (kernels/chunks.py: cut from the parameter's own
first element, its last row padded with zeros). Two codes:
  - 8 and 4 bits: integers on uniform levels under the row's largest magnitude (one fp32
    scale), averaged by the two-phase exchange (:func:`two_phase`);
  - 1 to 3 bits (:data:`LEVEL_BITS`): each value's sign and, in ``bits - 1`` more bits, which
    of the row's 2^(bits-1) magnitudes it takes; the magnitudes are the means of their
    groups (one fp32 each), the groups cut by a few rounds of Lloyd's algorithm (Lloyd, "Least
    squares quantization in PCM", 1982), started from the optimal levels of a Gaussian (Max,
    1960). Averaged by one allgather, without a second rounding (:func:`gathered`). 1 bit is
    the sign times the row's mean magnitude (1-bit SGD's reconstruction, Seide et al. 2014);
    on Gaussian values 2 bits leave a third of 1 bit's squared error, 3 bits a tenth."""
from __future__ import annotations

import torch

from ..kernels import unpack_bits
from ..kernels.chunks import chunk_plan
from .wire import Field, Message

BITS = (1, 2, 3, 4, 8)
LEVEL_BITS = (1, 2, 3)  # a sign and bits - 1 bits of magnitude group (the module doc)
LLOYD_ROUNDS = 6
# the optimal magnitudes of a unit Gaussian's 2, 4 and 8 levels (Max 1960), by magnitudes
# per sign: Lloyd's rounds start from them, scaled by the row's mean magnitude over the
# Gaussian's (sqrt(2 / pi), the first)
_START = {1: (0.7979,), 2: (0.4528, 1.5104), 4: (0.2451, 0.7560, 1.3440, 2.1520)}


def levels_of(bits: int) -> int:
    """Scales per row: the magnitudes of :data:`LEVEL_BITS` codes, else one."""
    return 2 ** (bits - 1) if bits in LEVEL_BITS else 1


def pack_signs(neg: torch.Tensor) -> torch.Tensor:
    """(..., 8m) bool -> (..., m) uint8, bit b of byte j = neg[..., 8j + b]."""
    bits = neg.reshape(*neg.shape[:-1], -1, 8).to(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=neg.device)  # made there: no copy
    return (bits << shifts).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """(..., m) uint8 -> (..., 8m) float: -1 where the bit is set, +1 elsewhere."""
    return 1.0 - 2.0 * unpack_bits(packed).float()


def _places(n: int, bits: int, device):
    """Where each of n ``bits``-bit values starts in its row: (first byte, bit in it)."""
    start = torch.arange(n, device=device) * bits
    return start // 8, (start % 8).int()


def pack_uint(v: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., n) integers in [0, 2^bits), bits <= 16 -> (..., n * bits / 8) uint8: value i's
    bit b at bit i * bits + b of the row (n * bits a multiple of 8). A value spans at most
    three bytes: its pieces are added into them (they share no bit)."""
    n, m = v.shape[-1], v.shape[-1] * bits // 8
    byte, shift = _places(n, bits, v.device)
    w = v.int() << shift
    out = torch.zeros(*v.shape[:-1], m + 2, dtype=torch.int32, device=v.device)
    for j in range(3):
        out.index_add_(-1, byte + j, (w >> (8 * j)) & 0xFF)
    return out[..., :m].to(torch.uint8)


def unpack_uint(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_uint`: (..., m) uint8 -> (..., 8m / bits) int64."""
    n = packed.shape[-1] * 8 // bits
    byte, shift = _places(n, bits, packed.device)
    p = torch.nn.functional.pad(packed, (0, 2)).int()
    w = p[..., byte] | (p[..., byte + 1] << 8) | (p[..., byte + 2] << 16)
    return ((w >> shift) & ((1 << bits) - 1)).long()


def _group(a: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
    """Each magnitude's group: how many of its row's ``cuts`` (R, L - 1) it exceeds."""
    g = torch.zeros(a.shape, dtype=torch.long, device=a.device)
    for j in range(cuts.shape[1]):  # a loop over levels (at most 7), not over parameters
        g += a > cuts[:, j : j + 1]
    return g


def magnitudes(a: torch.Tensor, levels: int, count: torch.Tensor):
    """Lloyd's rounds on each row's magnitudes ``a`` (R, c), of which ``count`` (R,) are
    real (the rest, padding zeros, are not counted) -> (each value's group (R, c), None for
    one level; each group's mean magnitude (R, levels)). A group left empty keeps its
    previous magnitude."""
    R = a.shape[0]
    mean = a.sum(1) / count.clamp(min=1)
    if levels == 1:
        return None, mean.unsqueeze(1)
    lev = torch.stack([mean * v for v in _START[levels]], 1) / _START[1][0]
    pad = (a.shape[1] - count).unsqueeze(1)
    ones = torch.ones_like(a)
    for _ in range(LLOYD_ROUNDS):
        g = _group(a, (lev[:, 1:] + lev[:, :-1]) / 2)
        sums = a.new_zeros(R, levels).scatter_add_(1, g, a)
        n = a.new_zeros(R, levels).scatter_add_(1, g, ones)
        n[:, :1] -= pad  # the padding zeros fall in the lowest group
        lev = torch.where(n > 0, sums / n.clamp(min=1), lev)
    return g, lev


def quantize(m: torch.Tensor, bits: int, count=None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (R, c) -> (codes (R, c * bits / 8) uint8, scales): 8 and 4 bits, scales (R,),
    round to nearest of 2^(bits-1) - 1 levels each side of 0 (4 bits: two codes per byte, low
    nibble first); 1 to 3 bits, scales (R, 2^(bits-1)): the sign plane, then the planes of
    each value's magnitude group, low bit first (each c / 8 bytes, bit b of byte j for value
    8j + b), the group means over ``count`` (R,) real elements (the module doc)."""
    if bits in LEVEL_BITS:
        if count is None:
            count = m.new_full((m.shape[0],), m.shape[1])
        g, lev = magnitudes(m.abs(), levels_of(bits), count)
        planes = [pack_signs(m < 0)] + [pack_signs((g >> j) & 1 == 1) for j in range(bits - 1)]
        return torch.cat(planes, 1), lev
    top = 2 ** (bits - 1) - 1
    scale = m.abs().amax(1) / top
    q = torch.round(m / scale.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1))
    q = q.clamp_(-top, top).to(torch.int8)
    if bits == 8:
        return q.view(torch.uint8), scale
    u = (q + 8).to(torch.uint8).view(m.shape[0], -1, 2)
    return u[..., 0] | (u[..., 1] << 4), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`quantize`: (..., R, bytes), its scales -> (..., R, c) fp32."""
    if bits in LEVEL_BITS:
        planes = codes.unflatten(-1, (bits, -1))
        signs = unpack_signs(planes[..., 0, :])
        if bits == 1:
            return signs * scale
        g = sum(unpack_bits(planes[..., j + 1, :]).long() << j for j in range(bits - 1))
        return signs * scale.gather(-1, g)
    if bits == 8:
        q = codes.view(torch.int8).float()
    else:
        q = torch.stack([(codes & 15), (codes >> 4)], -1).flatten(-2).float() - 8
    return q * scale.unsqueeze(-1)


ROWS = Message(
    "rows",
    Field("scales", torch.float32, "rows * levels", "each row's scales (8 and 4 bits: one, "
          "its largest magnitude over the levels each side of 0; 1 to 3 bits: `levels` = "
          "2^(bits-1), its magnitude groups' means, smallest first)"),
    Field("codes", torch.uint8, "rows * chunk * bits // 8", "each row's values rounded to "
          "their level: int8; or two 4-bit codes per byte (offset by 8, low nibble first); or "
          "1 to 3 bits: a plane of sign bits (bit b of byte j: value 8j + b is negative), then "
          "bits - 1 planes of the value's magnitude group, low bit first, `chunk / 8` bytes "
          "each"),
    note="8 and 4 bits (`levels` = 1): an all-to-all gives each rank every rank's copy of its "
         "share of the rows (`rows` = the share, one message per destination rank); it "
         "averages them in fp32, rounds again and an allgather returns every share (one "
         "message each). 1 to 3 bits: one allgather of every rank's rows. The parameters "
         "under `min_numel` go by an fp32 allreduce of their own.")


def row_bytes(codes, scale, bits: int, W: int | None = None) -> torch.Tensor:
    """Rows' scales and codes as :data:`ROWS` messages (``W``: one per rank, W equal shares)."""
    lay = ROWS.bind(rows=codes.shape[0] // (W or 1), chunk=8 * codes.shape[-1] // bits,
                    bits=bits, levels=levels_of(bits))
    return lay.pack(W, scales=scale, codes=codes)


def rows_of(got, R: int, nb: int, bits: int) -> torch.Tensor:
    """Decode :data:`ROWS` messages (W, bytes) holding R rows each -> (W, R, c)."""
    W, L = got.shape[0], levels_of(bits)
    f = ROWS.bind(rows=R, chunk=8 * nb // bits, bits=bits, levels=L).unpack(got)
    scales = f["scales"].reshape(W, R, L) if bits in LEVEL_BITS else f["scales"]
    return dequantize(f["codes"].reshape(W, R, nb), scales, bits)


def sum_ranks(rows: torch.Tensor) -> torch.Tensor:
    """(W, ...) -> the sum over ranks in rank order (the same bits on every rank)."""
    total = rows[0].clone()
    for r in rows[1:]:  # a loop over ranks, not over parameters
        total += r
    return total


def gathered(comm, codes, scale, bits: int) -> torch.Tensor:
    """Every rank's rows by allgather, averaged as they arrive."""
    got = comm.allgather(row_bytes(codes, scale, bits))
    return sum_ranks(rows_of(got, codes.shape[0], codes.shape[1], bits)).div_(comm.world_size)


def two_phase(comm, codes, scale, bits: int, share: int) -> torch.Tensor:
    """An all-to-all hands each rank every rank's copy of its ``share`` rows, which it
    averages and rounds again; an allgather returns the shares."""
    W, nb = comm.world_size, codes.shape[1]
    got = comm.all_to_all(row_bytes(codes, scale, bits, W))
    c2, s2 = quantize(sum_ranks(rows_of(got, share, nb, bits)).div_(W), bits)
    every = comm.allgather(row_bytes(c2, s2, bits))
    return rows_of(every, share, nb, bits).reshape(W * share, -1)


def param_rows(params, x: torch.Tensor, chunk: int):
    """The rows of ``chunk`` elements that each of ``params`` (a bucket's parameters, any
    order) is cut into from its own first element, in bucket order (kernels/chunks.py's
    cached ``ChunkPlan``): what each parameter sends depends on it alone."""
    params = sorted(params, key=lambda p: p.offset)
    return chunk_plan(tuple((p.offset, p.numel) for p in params), x.numel(), chunk, x.device)


# the int8 warm-up's rows: 256 elements (an fp32 scale costs 1/8 bit per value; a parameter's
# last row pads at most 255 bytes)
DENSE_CHUNK = 256


def dense_rows(x: torch.Tensor, params, comm, bits: int = 8,
               chunk: int = DENSE_CHUNK) -> torch.Tensor:
    """The average over ranks of x's ``params`` with ``bits``-bit rows on the wire (8 or 4):
    each parameter cut into rows of ``chunk`` from its own first element, each row rounded to
    the nearest of 2^(bits-1) - 1 levels each side of 0 under its largest magnitude, the
    two-phase exchange (:func:`two_phase`: summed in fp32 by the rank owning each share, that
    average rounded again). About (1 + 4 / chunk) bytes per value at 8 bits against an fp32
    allreduce's 4; each parameter's result depends on it alone (the layout rule of
    compressors/base.py). Elements of x outside ``params`` come back 0."""
    plan = param_rows(params, x, chunk)
    W = comm.world_size
    share = -(-plan.rows // W)
    m = plan.rows_of(x)
    m = torch.cat([m, m.new_zeros(W * share - plan.rows, chunk)])
    codes, scale = quantize(m, bits)
    avg = two_phase(comm, codes, scale, bits, share) if W > 1 else dequantize(codes, scale, bits)
    return plan.put(avg[:plan.rows], torch.zeros_like(x))
