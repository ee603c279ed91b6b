"""Deep Gradient Compression (Lin et al., "Deep Gradient Compression: Reducing the
Communication Bandwidth for Distributed Training", ICLR 2018, arXiv:1712.01887).

Momentum correction accumulates velocity *in the hook*, so the optimizer must not apply
momentum (or weight decay) a second time. How that is kept true whatever a scheduler
(OneCycleLR, CyclicLR), ``optimizer.load_state_dict`` or the user's code does to the
optimizer's param groups later (``SGDMomentum`` in hooks/optimizer/, which owns everything gradcomp does to a
user's optimizer):

  * the param groups keep the user's ``momentum``, ``nesterov`` and ``weight_decay`` at all
    times outside ``optimizer.step()``: schedulers, checkpoints and the user see what they
    set;
  * when DDP hands a bucket to the hook (during backward, on the caller's thread), the hook
    reads each parameter's values from its group: the values the optimizer would use in this
    step, as the scheduler set them;
  * an optimizer step pre-hook sets them to 0 for the duration of ``step()`` and a post-hook
    puts them back, so the optimizer applies ``w -= lr * result`` alone.

Options ``momentum``/``nesterov``/``weight_decay`` are for an optimizer that has none of its
own: then they are fixed, and a group that later gains momentum (a scheduler cycling it)
raises at ``optimizer.step()`` instead of silently applying it twice.

Algorithm, per parameter and step (velocity u, accumulation v, both fp32 per parameter; m
and wd the parameter's group's values at this step):
  1. g += wd * w; optionally clip each parameter's g to clip / sqrt(W) in L2 norm
     (local clipping; per parameter, so it does not depend on the bucket layout).
  2. u = m u + g;  v = v + u            (Nesterov: v = v + g + m u)
  3. Sparsity warm-up: the sent fraction falls exponentially from ``warmup_ratio`` to
     ``ratio`` over ``warmup_steps`` optimizer steps.
  4. Select the top-k of each parameter's |v| (sampled threshold, bounded exact correction:
     see topk.py). Parameters below ``min_numel`` elements are sent whole: v stays 0.
  5. v[idx] = 0; momentum factor masking: u[idx] = 0.
  6. Allgather (values, int32 indices, dense values), scatter-add, divide by W. The
     optimizer then does w -= lr * result.
During ``dense_steps`` steps 1-2 still run (the velocity goes on) and u (or g + m u) is
averaged whole: momentum SGD, with its momentum in one place.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..config import MethodConfig, VELOCITY, check
from .base import Compressor, register_method
from .topk import SPARSE, check_value_dtype, exchange_sparse, round_values, select, value_dtype

MOMENTUM_KEYS = ("momentum", "nesterov", "weight_decay")
MOMENTUM_OFF = {"momentum": 0.0, "nesterov": False, "weight_decay": 0.0}


@dataclass(frozen=True)
class DGCConfig(MethodConfig):
    """ratio: final fraction sent, in (0, 1]. momentum/nesterov/weight_decay: only for an
    optimizer without momentum of its own (by default they are read from the optimizer's
    param groups at every step). masking: momentum factor masking. clip: local gradient
    clipping norm (0 = off). warmup_steps/warmup_ratio: exponential sparsity warm-up.
    value_dtype: the sent values' type (see topk: auto sends 2-byte values for fp16/bf16
    gradients; the accumulation keeps what rounding takes)."""

    ratio: float = 0.001
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    masking: bool = True
    clip: float = 0.0
    warmup_steps: int = 0
    warmup_ratio: float = 0.25
    sample_ratio: float = 0.01
    value_dtype: str = "auto"

    def validate(self):
        check(0 < self.ratio <= 1, "ratio", self.ratio, "a number in (0, 1]")
        check_value_dtype(self.value_dtype)
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

    def fixed(self) -> bool:
        """Momentum/weight decay given as options (not read from the optimizer)."""
        return any(getattr(self, k) != MOMENTUM_OFF[k] for k in MOMENTUM_KEYS)


@functools.lru_cache(maxsize=256)
def _lengths(layout: tuple, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment lengths covering a bucket of n elements, one per parameter ((offset, numel)
    pairs) and one per gap between them, and which segments are gaps (left unclipped)."""
    out, gap, pos = [], [], 0
    for off, numel in sorted(layout):
        if off > pos:
            out.append(off - pos), gap.append(True)
        out.append(numel), gap.append(False)
        pos = off + numel
    if pos < n:
        out.append(n - pos), gap.append(True)
    return (torch.tensor(out, dtype=torch.int64, device=device),
            torch.tensor(gap, dtype=torch.bool, device=device), tuple(out))


def segment_norms(x: torch.Tensor, lengths: torch.Tensor, sizes: tuple,
                  by_views: bool | None = None) -> torch.Tensor:
    """The L2 norm of each segment of x (consecutive runs of ``lengths``; ``sizes`` the same
    as ints). On the CPU a segment reduction of x * x; on a GPU (``by_views`` None) one
    multi-tensor norm over the segments' views: torch's CUDA segment_reduce sums a segment
    in one thread (bench/RESULTS.md, "Kernels on a GPU")."""
    if by_views is None:
        by_views = x.device.type != "cpu"
    if by_views:
        return torch.stack(torch._foreach_norm(x.split(list(sizes)), 2))
    return torch.segment_reduce(x * x, "sum", lengths=lengths).sqrt_()


def _per_element(values, ctx):
    """A per-parameter list as a per-element tensor of the bucket (a float stays a float)."""
    if not isinstance(values, list):
        return values
    numels = torch.tensor([p.numel for p in ctx.params])
    return torch.repeat_interleave(torch.tensor(values, dtype=torch.float32), numels).to(ctx.device)


@register_method
class DGC(Compressor):
    Config = DGCConfig
    name = "dgc"
    description = "Deep Gradient Compression: top-k with momentum correction, masking, warm-up"
    messages = (SPARSE,)  # top-k's
    # (Compressor.measured) AdamW: "freeze" measured with the fp32 warm-up, 1 seed
    measured = {"sgd_points": -5.4, "adamw_gap_pct": {"freeze": 18.8, "momentum": 15.1}}

    reads_momentum = True  # hooks/optimizer/ hands it the SGD optimizer's values

    def __init__(self, config):
        super().__init__(config)
        self.source = None  # hooks/optimizer/'s SGDMomentum, once bound

    @classmethod
    def sharded_refusal(cls, config, decays: bool) -> str | None:
        if config.weight_decay or decays:
            return ("dgc with weight decay under FSDP (1-D mesh): its weight decay reads every "
                    "parameter's values in the exchange, and a rank holds only its shard; "
                    "allowed: weight_decay=0, HSDP (a 2-D mesh), or 'topk'")
        return None

    def attach_momentum(self, source) -> None:
        self.source = source

    def unbind(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None

    def __getstate__(self):
        return {**self.__dict__, "source": None}  # the optimizer stays with the process

    def reads_params(self, live) -> bool:
        if live is None:
            return bool(self.config.weight_decay)
        wd = live[2]
        return any(wd) if isinstance(wd, list) else bool(wd)

    def live(self, names):
        return self.source.values(names) if self.source is not None else None

    def _hyper(self, ctx):
        live = ctx.live
        if live is None:
            cfg = self.config
            return cfg.momentum, cfg.nesterov, cfg.weight_decay
        m, nesterov, wd = live
        if isinstance(nesterov, list):
            on = {bool(n) for n, mm in zip(nesterov, m) if mm}
            if len(on) > 1:
                raise ValueError("dgc needs one nesterov setting for the parameter groups "
                                 "that have momentum")
            nesterov = on.pop() if on else False
            if isinstance(m, list) and len(set(m)) == 1:
                m = m[0]
        if isinstance(wd, list) and len(set(wd)) == 1:
            wd = wd[0]
        return _per_element(m, ctx), nesterov, _per_element(wd, ctx)

    def _velocity(self, x, ctx):
        """Steps 1-2: weight decay, clipping, momentum correction; x becomes what goes into
        the accumulation (u, or g + m u with Nesterov). Returns u (None without momentum).
        m and wd are floats, or per-element tensors where the bucket's groups differ."""
        cfg = self.config
        m, nesterov, wd = self._hyper(ctx)
        if isinstance(wd, torch.Tensor):
            x.addcmul_(ctx.param_values(), wd)
        elif wd:
            x.add_(ctx.param_values(), alpha=wd)
        if cfg.clip:  # each parameter's own L2 norm, all at once (segment sums)
            limit = cfg.clip / math.sqrt(ctx.comm.world_size)
            lengths, gap, sizes = _lengths(tuple((p.offset, p.numel) for p in ctx.params),
                                           x.numel(), x.device)
            norm = segment_norms(x, lengths, sizes)
            factor = (limit / (norm + 1e-12)).clamp_(max=1.0).masked_fill_(gap, 1.0)
            x.mul_(torch.repeat_interleave(factor, lengths, output_size=x.numel()))
        if not isinstance(m, torch.Tensor) and not m:
            return None
        u, nxt = ctx.memory_next(VELOCITY)  # rewritten whole: u m + x
        u = torch.mul(u, m, out=nxt).add_(x)
        if not nesterov:
            x.copy_(u)
        elif isinstance(m, torch.Tensor):
            x.addcmul_(u, m)
        else:
            x.add_(u, alpha=m)
        return u

    def dense(self, x, ctx):
        self._velocity(x, ctx)
        return super().dense(x, ctx)

    def reduce(self, x, ctx):
        cfg = self.config
        u = self._velocity(x, ctx)
        big, dense = self.split(ctx.params)
        if not big:  # everything sent: nothing accumulates, u keeps its momentum
            return super().dense(x, ctx)
        y = self.add_residual(x, ctx, "accumulation")  # y = x + v, the next accumulation
        ratio = cfg.ratio_at(ctx.step)
        ctx.log("sparsity", 1.0 - ratio)
        vals, idx = select(y, big, ctx, ratio, cfg.sample_ratio)
        # the accumulation keeps what rounding takes
        wire, vals = round_values(vals, value_dtype(cfg.value_dtype, ctx))
        if u is not None and cfg.masking:
            # padding slots carry value 0: they must not mask anything
            u.index_add_(0, idx, u.index_select(0, idx) * (vals != 0), alpha=-1)
        return exchange_sparse(wire, vals, idx, y, x, dense, ctx)
