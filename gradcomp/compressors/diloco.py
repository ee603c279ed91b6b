"""DiLoCo: local steps, an outer Nesterov step, the pseudo-gradient dense in a few bits
(Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023, arXiv:2311.08105; int8 pseudo-gradients as in INTELLECT-1, Jaghouar et al. 2024,
arXiv:2412.01152; 4-bit outer updates as in Streaming DiLoCo, Douillard et al. 2025,
arXiv:2501.18512).

Every rank takes ``local_steps`` (H) optimizer steps on its own gradients; at the end of the
round its pseudo-gradient D (hooks/local_steps.py) comes here, per parameter, in fp32:
  1. y = D + e (error feedback: what the rounding took last round).
  2. Each parameter is cut into rows of ``chunk`` elements from its own first element; a row
     travels in ``bits`` bits per value (compressors/rows.py): at 8 and 4 bits integers
     round(y / s) with s = max|y| / (2^(bits-1) - 1) in fp32; at 1 to 3 bits each value's
     sign and which of the row's 2^(bits-1) magnitudes it takes (groups cut by Lloyd's
     algorithm, each sent as its mean in fp32).
  3. e = y - what was sent.
  4. At 8 and 4 bits, a reduce-scatter of the rows: an all-to-all hands each rank every
     rank's copy of its share of the rows; it decodes them, sums in fp32 (rank order) and
     divides by W; the average is quantized again the same way (that rounding is not fed
     back: it is the same on every rank and unbiased to half a step); an allgather returns
     the shares. At 1 to 3 bits, one allgather of every rank's rows, averaged as they
     arrive (no second rounding).
Every rank decodes the same bytes: the average is the same on every rank. Bytes sent per
rank and value: 2 (W - 1) / W * bits / 8 by the two phases (a ring allreduce of the
quantized rows), (W - 1) * bits / 8 by the allgather: the same at W = 2, and the two-phase
exchange cheaper from W = 3 on. Parameters named in ``exact`` (or below ``min_numel``, 0 by
default: every parameter goes quantized) go in a plain fp32 allreduce of their own.
The outer step (``outer_lr``, ``outer_momentum``: torch's SGD with Nesterov,
hooks/local_steps.py) applies the average.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MethodConfig, RESIDUAL, check
from .base import Compressor, dense_values, positions, register_method, zero_dense
from .rows import BITS, LEVEL_BITS, ROWS, dequantize, gathered, param_rows, quantize, two_phase

@dataclass(frozen=True)
class DiLoCoConfig(MethodConfig):
    """bits: 8 (int8, as INTELLECT-1), 4 (as Streaming DiLoCo), 3, 2 or 1 per value (1 to 3:
    a sign and a magnitude group, by allgather: compressors/rows.py). chunk: elements per row
    (each parameter cut from its own first element), a multiple of 8; a row carries one fp32
    scale, or 2^(bits-1) at 1 to 3 bits (0.125 bits per value at 3 bits and 1024).
    min_numel: 0 (every parameter quantized: a row's scale fits a small one too).
    Defaults with Adam/AdamW (``adam_defaults``), measured on the GPT (2000 steps, 2 ranks;
    bench/RESULTS.md, "Local steps and torchft's DiLoCo"): DiLoCo's own outer step
    (``outer_lr`` 0.7, Nesterov ``outer_momentum`` 0.9) every 16 steps, 3 bits per value,
    after 100 synchronous steps in int4 rows, each rank's Adam left as it is (``adam`` off:
    its own second moment, the user's clip). The synchronous start is what holds a short
    run, and the frozen second moment lost with the Nesterov outer step (the probes:
    docs/delay-and-local-steps.md, "The local-steps methods"). Without Adam:
    ``local_steps`` 2, ``outer_lr`` 1.5 without ``outer_momentum`` (each rank's steps are
    shorter in noisy coordinates than DDP's, about 1/sqrt(W)); the CNN rows of RESULTS."""

    min_numel: int = 0
    local_steps: int = 2
    outer_lr: float = 1.5
    outer_momentum: float = 0.0
    bits: int = 3
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
    # (Compressor.measured) AdamW, the GPT, 2000 steps, seeds 0-2: 1.5778 / 1.5470 / 1.5809
    # against allreduce's 1.6083 / 1.6027 / 1.6227 (-2.65% on the mean), 80x fewer bytes
    # (bench/RESULTS.md, "Local steps and torchft's DiLoCo")
    measured = {"adamw_gap_pct": {"local": -2.65}}
    # with Adam/AdamW: 100 synchronous steps in int4 rows, then DiLoCo's outer step every 16
    # steps, each rank's Adam its own (adam off)
    adam_defaults = {"local_steps": 16, "sync_steps": 100, "outer_lr": 0.7,
                     "outer_momentum": 0.9, "dense_wire": "int4", "adam": "off"}
    description = ("local steps, outer Nesterov, the pseudo-gradient dense in 1 to 8 bits with "
                   "per-row scales and error feedback (DiLoCo)")
    messages = (ROWS,)

    def exchange(self, x, ctx, big, dense):
        cfg, comm = self.config, ctx.comm
        y = self.add_residual(x, ctx)
        plan = param_rows(big, x, cfg.chunk)
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


