"""Rows of per-parameter chunks in a few bits, and their two-phase average: DiLoCo's
pseudo-gradient (compressors/diloco.py) and the int8 dense warm-up (``dense_wire="int8"``,
:func:`dense_rows`).

A row is ``chunk`` elements of one parameter (kernels/chunks.py: cut from the parameter's own
first element, its last row padded with zeros), sent as integers with one fp32 scale."""
from __future__ import annotations

import torch

from ..kernels.chunks import chunk_plan
from .wire import Field, Message

BITS = (1, 4, 8)


def pack_signs(neg: torch.Tensor) -> torch.Tensor:
    """(..., 8m) bool -> (..., m) uint8, bit b of byte j = neg[..., 8j + b]."""
    bits = neg.reshape(*neg.shape[:-1], -1, 8).to(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=neg.device)  # made there: no copy
    return (bits << shifts).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """(..., m) uint8 -> (..., 8m) float: -1 where the bit is set, +1 elsewhere."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return (1.0 - 2.0 * bits.float()).reshape(*packed.shape[:-1], -1)


def quantize(m: torch.Tensor, bits: int, count=None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (R, c) -> (codes (R, c * bits / 8) uint8, scales (R,) fp32): round to nearest of
    2^(bits-1) - 1 levels each side of 0 (4 bits: two codes per byte, low nibble first);
    1 bit: the sign, the row's scale its mean magnitude over ``count`` (R,) real elements
    (1-bit SGD's reconstruction, Seide et al. 2014)."""
    if bits == 1:
        scale = m.abs().sum(1) / count.clamp(min=1)
        return pack_signs(m < 0), scale
    top = 2 ** (bits - 1) - 1
    scale = m.abs().amax(1) / top
    q = torch.round(m / scale.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1))
    q = q.clamp_(-top, top).to(torch.int8)
    if bits == 8:
        return q.view(torch.uint8), scale
    u = (q + 8).to(torch.uint8).view(m.shape[0], -1, 2)
    return u[..., 0] | (u[..., 1] << 4), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`quantize`: (..., R, bytes), (..., R) -> (..., R, c) fp32."""
    if bits == 1:
        return unpack_signs(codes) * scale.unsqueeze(-1)
    if bits == 8:
        q = codes.view(torch.int8).float()
    else:
        q = torch.stack([(codes & 15), (codes >> 4)], -1).flatten(-2).float() - 8
    return q * scale.unsqueeze(-1)


ROWS = Message(
    "rows",
    Field("scales", torch.float32, "rows", "each row's scale (8 and 4 bits: its largest "
          "magnitude over the levels each side of 0; 1 bit: its mean magnitude)"),
    Field("codes", torch.uint8, "rows * chunk * bits // 8", "each row's values rounded to "
          "their level: int8; or two 4-bit codes per byte (offset by 8, low nibble first); or "
          "sign bits (bit b of byte j: value 8j + b is negative)"),
    note="8 and 4 bits: an all-to-all gives each rank every rank's copy of its share of the "
         "rows (`rows` = the share, one message per destination rank); it averages them in "
         "fp32, rounds again and an allgather returns every share (one message each). 1 bit: "
         "one allgather of every rank's rows. The parameters under `min_numel` go by an "
         "fp32 allreduce of their own.")


def row_bytes(codes, scale, bits: int, W: int | None = None) -> torch.Tensor:
    """Rows' scales and codes as :data:`ROWS` messages (``W``: one per rank, W equal shares)."""
    lay = ROWS.bind(rows=scale.numel() // (W or 1), chunk=8 * codes.shape[-1] // bits, bits=bits)
    return lay.pack(W, scales=scale, codes=codes)


def rows_of(got, R: int, nb: int, bits: int) -> torch.Tensor:
    """Decode :data:`ROWS` messages (W, bytes) holding R rows each -> (W, R, c)."""
    W = got.shape[0]
    f = ROWS.bind(rows=R, chunk=8 * nb // bits, bits=bits).unpack(got)
    return dequantize(f["codes"].reshape(W, R, nb), f["scales"], bits)


def sum_ranks(rows: torch.Tensor) -> torch.Tensor:
    """(W, ...) -> the sum over ranks in rank order (the same bits on every rank)."""
    total = rows[0].clone()
    for r in rows[1:]:  # a loop over ranks, not over parameters
        total += r
    return total


def gathered(comm, codes, scale) -> torch.Tensor:
    """Every rank's rows by allgather, averaged as they arrive."""
    got = comm.allgather(row_bytes(codes, scale, 1))
    return sum_ranks(rows_of(got, codes.shape[0], codes.shape[1], 1)).div_(comm.world_size)


def two_phase(comm, codes, scale, bits: int, share: int) -> torch.Tensor:
    """An all-to-all hands each rank every rank's copy of its ``share`` rows, which it
    averages and rounds again; an allgather returns the shares."""
    W, nb = comm.world_size, codes.shape[1]
    got = comm.all_to_all(row_bytes(codes, scale, bits, W))
    c2, s2 = quantize(sum_ranks(rows_of(got, share, nb, bits)).div_(W), bits)
    every = comm.allgather(row_bytes(c2, s2, bits))
    return rows_of(every, share, nb, bits).reshape(W * share, -1)


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
    params = sorted(params, key=lambda p: p.offset)
    plan = chunk_plan(tuple((p.offset, p.numel) for p in params), x.numel(), chunk, x.device)
    W = comm.world_size
    share = -(-plan.rows // W)
    m = plan.rows_of(x)
    m = torch.cat([m, m.new_zeros(W * share - plan.rows, chunk)])
    codes, scale = quantize(m, bits)
    avg = two_phase(comm, codes, scale, bits, share) if W > 1 else dequantize(codes, scale, bits)
    return plan.put(avg[:plan.rows], torch.zeros_like(x))
