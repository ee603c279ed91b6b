"""SparseLoCo: local steps whose pseudo-gradients travel as chunk-wise top-k with error
feedback and a few bits per value (Sarfi, Thérien, Lidin and Belilovsky, "Communication
Efficient LLM Pre-training with SparseLoCo", 2025, arXiv:2508.15706).

Every rank takes ``local_steps`` (H) optimizer steps on its own gradients; at the end of the
round its pseudo-gradient D (where the round started less where it ended,
hooks/local_steps.py) comes here, per parameter, in fp32:
  1. y = decay * e + D: error feedback (in the paper its decay plays the part of DiLoCo's
     outer momentum, and no outer momentum is needed: ``outer_momentum=0``).
  2. Each parameter is cut into rows of ``chunk`` elements from its own first element; each
     row keeps its ``k`` largest |y| (torch.topk, largest first).
  3. The kept values are quantized: the row's k values in rank order form ``levels`` groups
     of k/levels; each group is sent as the mean of its magnitudes (one fp32 per group and
     row) and each value as its sign alone. A value's group follows from its place in the
     message, so a value costs one bit whatever ``levels`` is; its place in the row costs
     the bits that count to ``chunk`` (12 at the default 4096), packed end to end.
  4. e = y - what was sent (the unsent values, and what the quantization took).
  5. One allgather carries every rank's (indices, signs, group means) and the parameters
     sent dense (below ``min_numel``, or named in ``exact``); every rank decodes them all in
     rank order and averages: every rank gets the same values.
The outer step (``outer_lr``, hooks/local_steps.py) applies the average.

Bytes per row and rank: 12k/8 (indices, at chunk 4096) + k/8 (signs) + 4 * levels (group
means): with the defaults, 224 bytes for 4096 fp32 elements (16 KiB), 73x fewer bytes per round
than a dense fp32 exchange of the round, times H against a per-step allreduce (H: 4, 8 from
step 500, 16 from step 1004).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..config import MethodConfig, RESIDUAL, check
from .base import Compressor, dense_values, put_dense, register_method, zero_dense
from .rows import pack_signs, pack_uint, param_rows, unpack_signs, unpack_uint
from .wire import DENSE, Field, Message

MAX_CHUNK = 32768  # a row's places fit in 15 bits


MESSAGE = Message(
    "every rank's rows, all-gathered",
    Field("groups", torch.float32, "rows * levels", "per row, each group's mean magnitude (the "
          "group of a kept value follows from its rank in the row)"),
    DENSE,
    Field("indices", torch.uint8, "rows * k * bits // 8", "per row, its kept values' places "
          "in the row, largest first, `bits` each (the bits that count to `chunk`), packed end "
          "to end (bit b of place i at bit i * bits + b of the row)"),
    Field("signs", torch.uint8, "rows * k // 8", "per row, its kept values' signs, one bit "
          "each (bit b of byte j: value 8j + b is negative)"),
    note="`rows`: each compressed parameter cut into rows of `chunk` elements (its last row "
         "short); `k` values kept per row, in `levels` groups of `k / levels`.")


def index_bits(chunk: int) -> int:
    """The bits of a place in a row of ``chunk`` elements (k is a multiple of 8, so a row's
    places fill whole bytes)."""
    return max(1, (chunk - 1).bit_length())


@dataclass(frozen=True)
class SparseLoCoConfig(MethodConfig):
    """chunk: elements per row (each parameter cut from its own first element), at most
    32768. k: values kept per row, a multiple of 8 and at most ``chunk`` (128 of 4096: 3.1%,
    the top of the paper's 1-3%). levels: magnitude groups per row (each sent as one fp32
    mean; a value costs one bit, its sign, whatever the number), dividing k.
    decay: the error feedback's decay, in (0, 1] (the paper's beta, 0.95 there; 1 here: with
    a few steps per round a value waits tens of rounds for its turn, and a decay throws most
    of it away: measured on the GPT, docs/delay-and-local-steps.md).
    min_numel: 64 (a parameter of 64 elements or more goes as rows, a small one as one short
    row: sent dense, the biases and norms of a small model cost more than its matrices'
    rows; below 56 elements a row's 224 bytes cost more than the values).
    The local-steps options default to the method's own settings: ``local_steps`` 4,
    ``outer_lr`` 1.5 (about the square root of the replicas: each rank's Adam takes shorter
    steps in noisy coordinates than DDP's), no ``outer_momentum``, and rounds that grow
    (``grow_every`` 500, ``max_local_steps`` 16: 8 steps from step 500 of rounds, 16 from
    step 1004, the outer lr scaled by the square root of the length). Longer rounds want a
    larger outer step and lose on short runs (8 steps a round from the start lost 0.09 nats
    on the tests' 300-step GPT-tiny), so they come once a run is long
    (docs/delay-and-local-steps.md)."""

    min_numel: int = 64
    local_steps: int = 4
    grow_every: int = 500
    max_local_steps: int = 16
    outer_lr: float = 1.5
    outer_momentum: float = 0.0
    chunk: int = 4096
    k: int = 128
    levels: int = 4
    decay: float = 1.0

    def validate(self):
        check(1 <= self.chunk <= MAX_CHUNK, "chunk", self.chunk, f"an integer in [1, {MAX_CHUNK}]")
        check(8 <= self.k <= self.chunk and self.k % 8 == 0, "k", self.k,
              f"a multiple of 8 in [8, chunk={self.chunk}]")
        check(1 <= self.levels <= self.k and self.k % self.levels == 0, "levels", self.levels,
              f"an integer >= 1 that divides k={self.k}")
        check(0 < self.decay <= 1, "decay", self.decay, "a number in (0, 1]")


@register_method
class SparseLoCo(Compressor):
    Config = SparseLoCoConfig
    name = "sparseloco"
    residual_slot = RESIDUAL
    # (Compressor.measured) AdamW, the GPT, 2000 steps, seeds 0-2: 1.5997 / 1.5938 / 1.6074
    # against allreduce's 1.6083 / 1.6027 / 1.6227 (-0.68% on the mean), 506x fewer bytes
    # (bench/RESULTS.md, "Accuracy with AdamW")
    measured = {"adamw_gap_pct": {"local": -0.68}}
    description = ("local steps, their pseudo-gradient as chunk-wise top-k with 1-bit values "
                   "and per-group scales, decayed error feedback (SparseLoCo)")
    messages = (MESSAGE,)

    def exchange(self, x, ctx, big, dense):
        cfg, W = self.config, ctx.comm.world_size
        y = self.add_residual(x, ctx, decay=cfg.decay)
        plan = param_rows(big, x, cfg.chunk)
        rows, c, k, L = plan.rows, cfg.chunk, cfg.k, cfg.levels
        m = plan.rows_of(y)
        mag = m.abs().masked_fill_(~plan.valid, -1.0)  # padding only where a row runs short
        top, idx = mag.topk(k, dim=1)  # largest first: a value's rank gives its group
        kept = top >= 0
        groups = (top.clamp(min=0) * kept).view(rows, L, k // L).sum(-1)
        groups = groups / kept.view(rows, L, k // L).sum(-1).clamp(min=1)
        vals = m.gather(1, idx)
        neg = vals < 0
        if y is not x:  # e = y - sent, at the rows' kept places; 0 at the dense parameters
            sent = groups.repeat_interleave(k // L, dim=1) * (1.0 - 2.0 * neg.float()) * kept
            m.scatter_(1, idx, vals - sent)
            plan.put(m, y)
            zero_dense(y, dense)
        d = dense_values(x, dense)
        b = index_bits(c)
        lay = MESSAGE.bind(rows=rows, levels=L, k=k, bits=b, n_dense=d.numel())
        got = lay.unpack(ctx.comm.allgather(lay.pack(
            groups=groups, dense=d, indices=pack_uint(idx, b), signs=pack_signs(neg))))
        r_grp = got["groups"].reshape(W, rows, L)
        r_idx = unpack_uint(got["indices"].reshape(W, rows, k * b // 8), b)
        r_sign = unpack_signs(got["signs"].reshape(W, rows, k // 8))
        r_vals = r_sign * r_grp.repeat_interleave(k // L, dim=2)
        r_pos = r_idx + torch.arange(rows, device=x.device).view(1, rows, 1) * c
        acc = x.new_zeros(rows * c)
        kernels.scatter_add(r_vals, r_pos, acc)  # rank order: the same sums on every rank
        out = x.zero_()
        plan.put(acc.div_(W), out)
        put_dense(got["dense"], dense, out)
        return out
