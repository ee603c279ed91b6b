"""Top-k sparsification with error feedback (Stich et al., "Sparsified SGD with Memory",
NeurIPS 2018; Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
EMNLP 2017).

Algorithm, per parameter and step (parameters below ``min_numel`` elements go dense):
  1. y = g + e (error feedback).
  2. Estimate the magnitude threshold of the k = ceil(ratio * n) largest |y| from a random
     sample of ``sample_ratio * n`` elements (no sort of the tensor).
  3. Compact up to 2k candidates at or above it, take the exact top k of those.
  4. e = y - sent. One allgather per bucket carries every parameter's (values, int32
     indices) and the dense parameters' values; scatter-add; divide by W.
Each rank sends 8k bytes; every rank receives 8k(W-1): it pays when ratio < 1/(2W).
Selection is per parameter (as in the DGC authors' code), so a tensor's share of the message
does not depend on which neighbours DDP put in its bucket.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import kernels
from ..config import MethodConfig, RESIDUAL, check
from ..kernels import segmented
from ..kernels.host import to_device
from .base import Compressor, positions, register_method
from .wire import DENSE, Field, Message


@dataclass(frozen=True)
class TopKConfig(MethodConfig):
    """ratio: fraction of each parameter's elements sent, in (0, 1]; 0.05 by default (on CIFAR
    ResNet-18 under OneCycleLR, 3 seeds: -1.2 points against -2.3 at 0.01; bench/RESULTS.md
    section 4); lower it for less bandwidth at that cost.
    sample_ratio: fraction of elements sampled to estimate the threshold, in (0, 1].
    value_dtype: the sent values' type: auto (the gradient's: fp16/bf16 gradients send
    2-byte values, fp32 ones 4-byte), fp32, fp16 or bf16.
    start_ratio, decay_steps: a wider ratio after the dense warm-up: ``start_ratio`` at the
    first compressed step, falling exponentially to ``ratio`` over ``decay_steps`` compressed
    steps, in quarter-octave stages (a few distinct ratios: each has its selection tables
    built once). Off by default (0, or any start_ratio at or below ``ratio``: a user's
    ``ratio=0.2`` with Adam runs 0.2 throughout); with Adam/AdamW 0.1 over 400 steps
    (``adam_defaults``)."""

    ratio: float = 0.05
    sample_ratio: float = 0.01
    value_dtype: str = "auto"
    start_ratio: float = 0.0
    decay_steps: int = 0

    def validate(self):
        check(0 < self.ratio <= 1, "ratio", self.ratio, "a number in (0, 1]")
        check(0 < self.sample_ratio <= 1, "sample_ratio", self.sample_ratio, "a number in (0, 1]")
        check_value_dtype(self.value_dtype)
        check(0 <= self.start_ratio <= 1, "start_ratio", self.start_ratio,
              "a number in [0, 1] (at or below ratio: off)")
        check(isinstance(self.decay_steps, int) and self.decay_steps >= 0, "decay_steps",
              self.decay_steps, "an integer >= 0")

    def ratio_at(self, compressed: int) -> float:
        """The fraction sent in the compressed step ``compressed`` (0: the first)."""
        if self.start_ratio <= self.ratio or compressed >= self.decay_steps:
            return self.ratio
        octaves = math.log2(self.start_ratio / self.ratio)
        left = round(4 * octaves * (1 - compressed / self.decay_steps)) / 4
        return min(self.start_ratio, self.ratio * 2.0 ** left)


VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def check_value_dtype(value: str) -> None:
    check(value == "auto" or value in VALUE_DTYPES, "value_dtype", value,
          "auto, " + ", ".join(VALUE_DTYPES))


def value_dtype(option: str, ctx) -> torch.dtype:
    """The dtype the sparse values travel in (``auto``: 2 bytes for fp16/bf16 gradients)."""
    if option != "auto":
        return VALUE_DTYPES[option]
    return ctx.grad_dtype if ctx.grad_dtype in (torch.float16, torch.bfloat16) else torch.float32


def round_values(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(values as they travel, in ``dtype``; the same as they arrive, fp32): clamped to the
    type's largest finite value, then rounded. Error feedback keeps the difference (the
    clamp's too): nothing is lost, only sent later; a scaled fp32 gradient never turns into
    an fp16 inf."""
    if dtype == torch.float32:
        return values, values
    big = torch.finfo(dtype).max
    wire = values.clamp(-big, big).to(dtype)
    return wire, wire.float()


def sparse_select(y: torch.Tensor, ratio: float, sample_ratio: float, seed: int, thresholds=None):
    """One parameter's (values, int64 indices): the per-parameter reference of :func:`select`
    (:func:`gradcomp.kernels.segmented.select_param`). The sampled threshold is appended to
    ``thresholds`` when a list is given."""
    vals, idx, thr = segmented.select_param(y, ratio, sample_ratio, seed)
    if thresholds is not None and thr is not None:
        thresholds.append(thr)
    return vals, idx


def select(x: torch.Tensor, params, ctx, ratio: float, sample_ratio: float):
    """Per-parameter top-k of the bucket x: (values, int64 indices into x) for ``params``, in
    a fixed number of ops whatever their count (:mod:`gradcomp.kernels.segmented`). Logs the
    mean sampled threshold when a writer is attached."""
    params = sorted(params, key=lambda p: p.offset)
    pl = segmented.topk_plan(tuple((p.offset, p.numel) for p in params), x.numel(), ratio,
                        sample_ratio, x.device)
    shifts = to_device([segmented.shift(ctx.seed(0, p.name), p.numel) for p in params],
                       torch.int64, x.device)
    vals, idx, thr = segmented.select(x, pl, shifts)
    if ctx.logging and pl.sampled:
        ctx.log("threshold", thr[pl.param_seg[list(pl.sampled)]].mean())
    return vals, idx


SPARSE = Message(
    "every rank's kept values, all-gathered",
    Field("indices", torch.int32, "k", "each kept value's place in the bucket"),
    Field("values", None, "k", "the kept values: float32, or 2 bytes (`value_dtype`)"),
    DENSE,
    note="`k`: the sum over the bucket's compressed parameters of their kept counts.")


def exchange_sparse(wire: torch.Tensor, vals: torch.Tensor, indices: torch.Tensor,
                    y: torch.Tensor, x: torch.Tensor, dense, ctx) -> torch.Tensor:
    """Allgather every rank's (indices, values) and the ``dense`` parameters' values of x as
    one message (:data:`SPARSE`); return the dense average. ``wire``: the values as they
    travel, in their own dtype (fp32, or 2 bytes: see :func:`round_values`), ``vals`` the
    same as they arrive (fp32); indices travel as int32. The message's fields are written in
    one pass (:func:`gradcomp.kernels.sparse_encode`), which also makes error feedback's
    update: y (from :meth:`Compressor.add_residual`) less vals at the indices (what is not
    sent, and what rounding took), 0 at the dense parameters; nothing when y is x."""
    at = positions(tuple((p.offset, p.numel) for p in dense), x.device)
    k, D = indices.numel(), at.numel()
    lay = SPARSE.bind(k=k, dtype=wire.dtype, n_dense=D)
    msg = torch.empty(lay.nbytes, dtype=torch.uint8, device=x.device)
    f = lay.unpack(msg)  # views of msg
    vals_at, dense_at = lay.spans["values"][0], lay.spans["dense"][0]
    pad = msg[vals_at + k * wire.element_size() : dense_at]
    kernels.sparse_encode(wire, vals, indices, y if y is not x else None, x, at, f["indices"],
                          f["values"], f["dense"], pad)
    got = ctx.comm.allgather(msg)  # (W, bytes)
    # the result in x, whose values are not read again (the message holds what was sent):
    # no fresh bucket-sized buffer (a page fault per 4 KB) and no copy of it into the bucket
    out = x.zero_()
    # every row read in place: its values added at its indices, its dense values summed
    kernels.sparse_decode(got, k, vals_at, wire.dtype, dense_at, out, at)
    return out.div_(ctx.comm.world_size)


@register_method
class TopK(Compressor):
    Config = TopKConfig
    name = "topk"
    # with Adam/AdamW: 10% of each parameter at the switch, falling to 2.5% over 400
    # compressed steps, values in bf16, the warm-up in int4 rows. On the GPT (the first moment
    # exchanged, the clip off the compressed steps; 600 steps, seed 0) ratio 0.025 throughout
    # ended +1.74% from allreduce, 0.05 +0.01%, 0.1 -1.03%: the wider ratio pays early, while
    # the learning rate is high; over 2000 steps 0.025 held (bench/RESULTS.md, "Accuracy with
    # AdamW", where the defaults' rows are)
    adam_defaults = {"ratio": 0.025, "start_ratio": 0.1, "decay_steps": 400,
                     "value_dtype": "bf16", "dense_wire": "int4"}
    # (Compressor.measured) AdamW: "freeze" measured at ratio 0.05 with the fp32 warm-up
    measured = {"sgd_points": -1.2, "adamw_gap_pct": {"freeze": 3.68, "momentum": -2.01}}
    residual_slot = RESIDUAL
    description = "top-k sparsification with error feedback (no momentum correction)"
    messages = (SPARSE,)

    def exchange(self, x, ctx, big, dense):
        cfg = self.config
        y = self.add_residual(x, ctx)  # y = x + e, in the next residual's buffer
        ratio = cfg.ratio_at(ctx.compressed)
        if cfg.start_ratio:
            ctx.log("ratio", ratio)
        vals, idx = select(y, big, ctx, ratio, cfg.sample_ratio)
        wire, vals = round_values(vals, value_dtype(cfg.value_dtype, ctx))
        return exchange_sparse(wire, vals, idx, y, x, dense, ctx)
