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
from ..config import MethodConfig, check
from .base import Compressor, dense_values, put_dense, register_method

# Candidate buffer = CAPACITY_FACTOR * k; the sampled threshold targets TARGET_FACTOR * k so
# that the count that passes (about 1.5k +- a few sqrt(k)) rarely overflows the buffer.
CAPACITY_FACTOR = 2
TARGET_FACTOR = 1.5
# The threshold is the MIN_SAMPLE_HITS-th largest sampled magnitude at least: its relative
# error is about 1/sqrt(MIN_SAMPLE_HITS), within what the 2x buffer absorbs.
MIN_SAMPLE_HITS = 32


@dataclass(frozen=True)
class TopKConfig(MethodConfig):
    """ratio: fraction of each bucket's elements sent, in (0, 1].
    sample_ratio: fraction of elements sampled to estimate the threshold, in (0, 1]."""

    ratio: float = 0.01
    sample_ratio: float = 0.01

    def validate(self):
        check(0 < self.ratio <= 1, "ratio", self.ratio, "a number in (0, 1]")
        check(0 < self.sample_ratio <= 1, "sample_ratio", self.sample_ratio, "a number in (0, 1]")


def sparse_select(y: torch.Tensor, ratio: float, sample_ratio: float, seed: int, thresholds=None):
    """(values, int32 indices) of about the ratio*n largest |y|; k fixed per (n, ratio).
    The sampled threshold is appended to ``thresholds`` when a list is given."""
    n = y.numel()
    k = max(1, math.ceil(ratio * n))
    if k >= n:  # every element: keep the sparse format so the path is the same one
        return y.clone(), torch.arange(n, dtype=torch.int32, device=y.device)
    target = min(n, math.ceil(TARGET_FACTOR * k))
    capacity = min(n, CAPACITY_FACTOR * k)
    g = torch.Generator(device=y.device)
    g.manual_seed(seed)
    # enough samples that ~MIN_SAMPLE_HITS of them land above the threshold
    m = min(n, max(math.ceil(sample_ratio * n), math.ceil(MIN_SAMPLE_HITS * n / target)))
    sample = torch.randint(0, n, (m,), generator=g, device=y.device)
    thr = kernels.sample_threshold(y, target, sample)
    if thresholds is not None:
        thresholds.append(thr)
    return kernels.select_topk(y, thr, k, capacity)


def select(x: torch.Tensor, params, ctx, ratio: float, sample_ratio: float):
    """Per-parameter top-k of the bucket x: (values, int32 indices into x) for ``params``.
    Logs the mean sampled threshold when a writer is attached."""
    vals, idxs = [], []
    thresholds = [] if ctx.logging else None
    for p in params:
        v, i = sparse_select(x[p.offset : p.offset + p.numel], ratio, sample_ratio,
                             ctx.seed(0, p.name), thresholds)
        vals.append(v)
        idxs.append(i.add_(p.offset))  # padding slots carry value 0: harmless anywhere
    if thresholds:
        ctx.log("threshold", torch.stack(thresholds).mean())
    return torch.cat(vals), torch.cat(idxs)


def exchange_sparse(values: torch.Tensor, indices: torch.Tensor, x: torch.Tensor, dense,
                    ctx) -> torch.Tensor:
    """Allgather every rank's (values, indices) and the ``dense`` parameters' values of x as
    one fp32 message; return the dense average."""
    k = values.numel()
    msg = torch.cat([values, indices.view(torch.float32), dense_values(x, dense)])
    got = ctx.comm.allgather(msg)  # (W, 2k + dense)
    out = torch.zeros(x.numel(), dtype=torch.float32, device=values.device)
    kernels.scatter_add(got[:, :k].contiguous(), got[:, k : 2 * k].contiguous().view(torch.int32), out)
    out.div_(ctx.comm.world_size)
    put_dense(got[:, 2 * k :], dense, out)
    return out


def zero_dense(e: torch.Tensor, dense) -> None:
    """Dense parameters are sent exactly: no error to keep."""
    for p in dense:
        e[p.offset : p.offset + p.numel].zero_()


@register_method
class TopK(Compressor):
    Config = TopKConfig
    name = "topk"
    residual_slot = "residual"
    description = "top-k sparsification with error feedback (no momentum correction)"

    def reduce(self, x, ctx):
        big, dense = self.split(ctx.params)
        if not big:
            return self.dense(x, ctx)
        cfg = self.config
        e = self.add_residual(x, ctx)
        vals, idx = select(x, big, ctx, cfg.ratio, cfg.sample_ratio)
        if e is not None:
            e.copy_(x).index_put_((idx.long(),), -vals, accumulate=True)
            zero_dense(e, dense)
        return exchange_sparse(vals, idx, x, dense, ctx)
