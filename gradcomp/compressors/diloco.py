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

from ..config import MethodConfig, RESIDUAL, check
from ..kernels.chunks import chunk_plan
from .base import Compressor, dense_values, positions, register_method, zero_dense
from .rows import BITS, LEVEL_BITS, ROWS, dequantize, gathered, quantize, two_phase

@dataclass(frozen=True)
class DiLoCoConfig(MethodConfig):
    """bits: 8 (int8), 4, or 1 per value (1: the sign, each row's mean magnitude as its
    scale; every rank's rows go by allgather and are averaged as they arrive, no second
    rounding). chunk: elements per row (one fp32 scale each), each parameter cut from its own
    first element; a multiple of 8.
    min_numel: 0 (every parameter quantized: a row's scale fits a small one too).
    bits=8 (int8, as INTELLECT-1): on 2 ranks with AdamW the parameters after two rounds
    differ from plain averaging's by 2% of their move at 8 bits, 12% at 4 (whatever the
    chunk: 4 bits' 15 levels, not the outliers), 40% at 1; a 300-step tiny GPT lost 0.13-0.23
    nats at 4 bits. chunk=1024: the fp32 scale costs 0.03 bits per value.
    The local-steps options default to the method's own settings: ``local_steps`` 5 (the
    fewest at which int8 rows save 16x against a dense exchange every step),
    ``outer_lr`` 1.5 without ``outer_momentum`` (measured on the GPT against DiLoCo's 0.7 and
    0.9, tuned for hundreds of steps per round: docs/delay-and-local-steps.md)."""

    min_numel: int = 0
    local_steps: int = 5
    outer_lr: float = 1.5
    outer_momentum: float = 0.0
    bits: int = 8
    chunk: int = 1024

    def validate(self):
        check(self.bits in BITS, "bits", self.bits, "1, 2, 3, 4 or 8")
        check(8 <= self.chunk <= 2**20 and self.chunk % 8 == 0, "chunk", self.chunk,
              "a multiple of 8 in [8, 2**20]")


@register_method
class DiLoCo(Compressor):
    Config = DiLoCoConfig
    name = "diloco"
    residual_slot = RESIDUAL
    # (Compressor.measured) AdamW, the GPT, 2000 steps, seed 0: 1.6725 against allreduce's
    # mean 1.6139 (5 seeds), 19x fewer bytes (bench/RESULTS.md, "Accuracy with AdamW"): the
    # quality of plain averaging every 5 steps
    measured = {"adamw_gap_pct": {"local": 3.63}}
    description = ("local steps, outer Nesterov, the pseudo-gradient dense in int8 or 4 bits "
                   "with per-row scales and error feedback (DiLoCo)")
    messages = (ROWS,)

    def exchange(self, x, ctx, big, dense):
        cfg, comm = self.config, ctx.comm
        y = self.add_residual(x, ctx)
        big = sorted(big, key=lambda p: p.offset)
        plan = chunk_plan(tuple((p.offset, p.numel) for p in big), x.numel(), cfg.chunk, x.device)
        rows, W = plan.rows, comm.world_size
        share = -(-rows // W)  # the two-phase exchange's rows per rank
        m = plan.rows_of(y)
        if cfg.bits not in LEVEL_BITS:  # the two-phase exchange: every rank's share whole
            m = torch.cat([m, m.new_zeros(W * share - rows, cfg.chunk)])
        codes, scale = quantize(m, cfg.bits, _counts(plan, m.shape[0]))
        if y is not x:
            plan.put(m[:rows] - dequantize(codes[:rows], scale[:rows], cfg.bits), y)
            zero_dense(y, dense)
        if cfg.bits in LEVEL_BITS:
            avg = gathered(comm, codes, scale, cfg.bits)
        else:
            avg = two_phase(comm, codes, scale, cfg.bits, share)
        dense_avg = comm.allreduce(dense_values(x, dense)).div_(W) if dense else None
        out = x.zero_()
        plan.put(avg[:rows], out)
        if dense:
            out.index_copy_(0, positions(tuple((p.offset, p.numel) for p in dense), out.device),
                            dense_avg)
        return out


def _counts(plan, n_rows: int) -> torch.Tensor:
    """Each row's real elements (n_rows: the plan's rows and the padding rows after them)."""
    c = plan.valid.sum(1).float()
    return torch.cat([c, c.new_zeros(n_rows - c.numel())])


