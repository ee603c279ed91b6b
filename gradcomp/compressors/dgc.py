"""Deep Gradient Compression (Lin et al., "Deep Gradient Compression: Reducing the
Communication Bandwidth for Distributed Training", ICLR 2018, arXiv:1712.01887).

Momentum moves from the optimizer into the hook (momentum correction), so the optimizer must
be plain SGD: :func:`gradcomp.register` takes the optimizer and moves its momentum, Nesterov
flag and weight decay here, so momentum can never be applied twice.

Algorithm, per parameter and step (velocity u, accumulation v, both fp32 per parameter):
  1. g += weight_decay * w; optionally clip each parameter's g to clip / sqrt(W) in L2 norm
     (local clipping; per parameter, so it does not depend on the bucket layout).
  2. u = m u + g;  v = v + u            (Nesterov: v = v + g + m u)
  3. Sparsity warm-up: the sent fraction falls exponentially from ``warmup_ratio`` to
     ``ratio`` over ``warmup_steps`` optimizer steps.
  4. Select the top-k of each parameter's |v| (sampled threshold, bounded exact correction:
     see topk.py). Parameters below ``min_numel`` elements are sent whole: v stays 0.
  5. v[idx] = 0; momentum factor masking: u[idx] = 0.
  6. Allgather (values, int32 indices, dense values), scatter-add, divide by W. The
     optimizer then does w -= lr * result.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import MethodConfig, check
from .base import Compressor, register_method
from .topk import exchange_sparse, select, zero_dense


@dataclass(frozen=True)
class DGCConfig(MethodConfig):
    """ratio: final fraction sent, in (0, 1]. momentum/nesterov/weight_decay: taken from the
    optimizer by register(). masking: momentum factor masking. clip: local gradient clipping
    norm (0 = off). warmup_steps/warmup_ratio: exponential sparsity warm-up."""

    ratio: float = 0.001
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    masking: bool = True
    clip: float = 0.0
    warmup_steps: int = 0
    warmup_ratio: float = 0.25
    sample_ratio: float = 0.01

    def validate(self):
        check(0 < self.ratio <= 1, "ratio", self.ratio, "a number in (0, 1]")
        check(0 <= self.momentum < 1, "momentum", self.momentum, "a number in [0, 1)")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        check(self.clip >= 0, "clip", self.clip, "a number >= 0 (0 = off)")
        check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        check(not self.warmup_steps or self.ratio <= self.warmup_ratio <= 1, "warmup_ratio", self.warmup_ratio,
              f"a number in [ratio={self.ratio}, 1]")
        check(0 < self.sample_ratio <= 1, "sample_ratio", self.sample_ratio, "a number in (0, 1]")
        check(not self.nesterov or self.momentum > 0, "nesterov", self.nesterov,
              "True only with momentum > 0")

    def ratio_at(self, step: int) -> float:
        """The fraction sent at optimizer step ``step`` (0-based)."""
        if step >= self.warmup_steps:
            return self.ratio
        return self.warmup_ratio * (self.ratio / self.warmup_ratio) ** (step / self.warmup_steps)


@register_method
class DGC(Compressor):
    Config = DGCConfig
    name = "dgc"
    description = "Deep Gradient Compression: top-k with momentum correction, masking, warm-up"

    def reduce(self, x, ctx):
        cfg = self.config
        if cfg.weight_decay:
            x.add_(ctx.param_values(), alpha=cfg.weight_decay)
        if cfg.clip:
            limit = cfg.clip / math.sqrt(ctx.comm.world_size)
            for p in ctx.params:
                g = x[p.offset : p.offset + p.numel]
                g.mul_((limit / (g.norm() + 1e-12)).clamp_(max=1.0))
        if cfg.momentum:
            u = ctx.memory("velocity")
            u.mul_(cfg.momentum).add_(x)
            if cfg.nesterov:
                x.add_(u, alpha=cfg.momentum)
            else:
                x.copy_(u)
        big, dense = self.split(ctx.params)
        if not big:  # everything sent: nothing accumulates, u keeps its momentum
            return self.dense(x, ctx)
        if cfg.error_feedback:
            v = ctx.memory("accumulation")
            x.add_(v)
        ratio = cfg.ratio_at(ctx.step)
        ctx.log("sparsity", 1.0 - ratio)
        vals, idx = select(x, big, ctx, ratio, cfg.sample_ratio)
        idx_l = idx.long()
        if cfg.error_feedback:
            v.copy_(x).index_put_((idx_l,), -vals, accumulate=True)
            zero_dense(v, dense)
        if cfg.momentum and cfg.masking:
            # padding slots carry value 0: they must not mask anything
            u.index_put_((idx_l,), -u[idx_l] * (vals != 0), accumulate=True)
        return exchange_sparse(vals, idx, x, dense, ctx)
