"""DiLoCo: local steps, an outer Nesterov step, the pseudo-gradient dense in a few bits
(Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023, arXiv:2311.08105; int8 pseudo-gradients as in INTELLECT-1, Jaghouar et al. 2024,
arXiv:2412.01152; 4-bit outer updates as in Streaming DiLoCo, Douillard et al. 2025,
arXiv:2501.18512).

Every rank takes ``local_steps`` (H) optimizer steps on its own gradients; at the end of the
round its pseudo-gradient D (hooks/local_steps.py) comes here, per parameter, in fp32:
  1. y = D + e (error feedback: what the rounding took last round).
  2. Each parameter is cut into rows of ``chunk`` elements from its own first element; a row
     travels as ``bits``-bit integers round(y / s) with its scale s = max|y| / (2^(bits-1) - 1)
     in fp32.
  3. e = y - what was sent.
  4. Reduce-scatter of the rows: an all-to-all hands each rank every rank's copy of its
     share of the rows; it decodes them, sums in fp32 (rank order) and divides by W; the
     average is quantized again the same way (that rounding is not fed back: it is the same
     on every rank and unbiased to half a step); an allgather returns the shares.
Every rank decodes the same bytes: the average is the same on every rank. Bytes per rank:
two messages of about half the rows each way at W = 2, as a ring allreduce of the
quantized rows. Parameters named in ``exact`` (or below ``min_numel``, 0 by default: every
parameter goes quantized) go in a plain fp32 allreduce of their own.
The outer step (``outer_lr``, ``outer_momentum``: torch's SGD with Nesterov,
hooks/local_steps.py) applies the average.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MethodConfig, check
from ..kernels.chunks import chunk_plan
from .base import Compressor, dense_values, positions, register_method, zero_dense
from .sparseloco import field

BITS = (4, 8)


def quantize(m: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (R, c) -> (codes (R, c * bits / 8) uint8, scales (R,) fp32): round to nearest of
    2^(bits-1) - 1 levels each side of 0 (4 bits: two codes per byte, low nibble first)."""
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
    if bits == 8:
        q = codes.view(torch.int8).float()
    else:
        q = torch.stack([(codes & 15), (codes >> 4)], -1).flatten(-2).float() - 8
    return q * scale.unsqueeze(-1)


@dataclass(frozen=True)
class DiLoCoConfig(MethodConfig):
    """bits: 8 (int8) or 4 per value. chunk: elements per row (one fp32 scale each), each
    parameter cut from its own first element; even for 4 bits.
    min_numel: 0 (every parameter quantized: a row's scale fits a small one too).
    The local-steps options default to the method's own settings: ``local_steps``,
    ``outer_lr`` and ``outer_momentum``."""

    min_numel: int = 0
    local_steps: int = 16
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    bits: int = 8
    chunk: int = 256

    def validate(self):
        check(self.bits in BITS, "bits", self.bits, "4 or 8")
        check(2 <= self.chunk <= 2**20 and self.chunk % 2 == 0, "chunk", self.chunk,
              "an even integer in [2, 2**20]")


@register_method
class DiLoCo(Compressor):
    Config = DiLoCoConfig
    name = "diloco"
    residual_slot = "residual"
    description = ("local steps, outer Nesterov, the pseudo-gradient dense in int8 or 4 bits "
                   "with per-row scales and error feedback (DiLoCo)")

    def exchange(self, x, ctx, big, dense):
        cfg, comm = self.config, ctx.comm
        W, bits = comm.world_size, cfg.bits
        y = self.add_residual(x, ctx)
        big = sorted(big, key=lambda p: p.offset)
        plan = chunk_plan(tuple((p.offset, p.numel) for p in big), x.numel(), cfg.chunk, x.device)
        rows = plan.rows
        share = -(-rows // W)
        m = torch.cat([plan.rows_of(y), y.new_zeros(W * share - rows, cfg.chunk)])
        codes, scale = quantize(m, bits)
        if y is not x:
            plan.put(m[:rows] - dequantize(codes[:rows], scale[:rows], bits), y)
            zero_dense(y, dense)
        nb = codes.shape[1]
        msg = torch.cat([codes.view(W, share * nb), scale.view(torch.uint8).view(W, share * 4)], 1)
        got = comm.all_to_all(msg)  # (W, ...): every rank's copy of my share
        mine = dequantize(got[:, : share * nb].reshape(W, share, nb),
                          field(got, share * nb, share * (nb + 4), torch.float32).view(W, share), bits)
        total = mine[0].clone()
        for r in mine[1:]:  # a loop over ranks, in rank order
            total += r
        c2, s2 = quantize(total.div_(W), bits)
        every = comm.allgather(torch.cat([c2.reshape(-1), s2.view(torch.uint8)]))
        avg = dequantize(every[:, : share * nb].reshape(W * share, nb),
                         field(every, share * nb, share * (nb + 4), torch.float32), bits)
        dense_avg = comm.allreduce(dense_values(x, dense)).div_(W) if dense else None
        out = x.zero_()
        plan.put(avg[:rows], out)
        if dense:
            out.index_copy_(0, positions(tuple((p.offset, p.numel) for p in dense), out.device),
                            dense_avg)
        return out
