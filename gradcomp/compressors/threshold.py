"""Threshold quantization with error feedback (Strom, "Scalable Distributed DNN Training Using
Commodity GPU Cloud Computing", Interspeech 2015).

Algorithm, per parameter of n >= ``min_numel`` elements and step (smaller parameters go as
plain fp32 values inside the same message); cap = ceil(max_ratio * n):
  1. y = g + e (error feedback).
  2. tau: fixed (``adaptive=false, tau=T``, Strom's setting), or adaptive (the default: a
     fixed tau depends on the model's gradient scale, which changes by orders of magnitude
     between models, layers and phases of training). Adaptive rule, per parameter and rank:
       est_t = the smallest non-zero value among the ceil((1 - quantile) * m) largest |y| of
               m elements sampled with replacement (generator ``ctx.seed(0, name)``), i.e.
               the ``quantile`` of |y| with zeros skipped (+inf if every sampled |y| is 0);
       tau_t = est_t at the first estimate, tau_{t-1} if est_t is +inf, else
               ema * tau_{t-1} + (1 - ema) * est_t   (torch.lerp, fp32).
     tau_t is kept per parameter in ``ctx.tensor("tau", name)`` (+inf = no estimate yet), so
     it is in the checkpoint and a resumed job is bit-exact. ``quantile`` defaults to
     1 - max_ratio / 2: about cap/2 elements pass, so the cap below rarely binds.
     m = min(n, max(sample_ratio * n, 32 / (1 - quantile), 32 n / (1.5 cap))): enough that
     about 32 sampled elements lie above each estimated order statistic.
  3. Send the elements with |y| > tau, at most cap of them. Cap rule, deterministic: when
     2 cap < n, the threshold is raised to the sampled estimate of the 1.5 cap-th largest |y|
     (as topk.py does), the first 2 cap elements at or above it in index order are compacted
     and the cap largest |y| of those are sent: when more than cap elements pass tau, about
     the cap largest are sent, never the first by index (which would starve the tensor's
     tail). When 2 cap >= n the cap largest |y| above tau are sent exactly. Whatever does
     not pass stays in the residual.
  4. Each sent element is sign(y) * tau: e = y - sent (the residual keeps the rest,
     including the part of large elements above tau).
  5. One allgather per bucket, of one int32 message of fixed size (no host sync to size it,
     the same size on every rank and step):
       [cap codes per compressed parameter | its tau (fp32 bits) | dense values (fp32 bits)]
     code = sign(y) * (index in the bucket + 1), 0 = an unused slot. Every rank sends its
     own tau (adaptive taus differ between ranks); the receiver decodes each element with
     its sender's tau, scatter-adds every rank's message and divides by W.
Bytes per rank: 4 cap + 4 per compressed parameter (+ 4 per dense element): half of top-k's
8k for the same k. Every rank receives (W - 1) times that (allgather).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import kernels
from ..config import MethodConfig, check
from .base import Compressor, dense_values, put_dense, register_method
from .topk import CAPACITY_FACTOR, MIN_SAMPLE_HITS, TARGET_FACTOR, zero_dense

_INF = float("inf")


@dataclass(frozen=True)
class ThresholdConfig(MethodConfig):
    """max_ratio: at most ceil(max_ratio * n) elements of a parameter sent per step, in (0, 1].
    adaptive: estimate tau per parameter from a sample (default); false needs a fixed tau.
    tau: the fixed threshold (> 0, finite), only with adaptive=false.
    quantile: the quantile of |y| the adaptive tau estimates, in (0, 1); None: 1 - max_ratio/2.
    ema: smoothing of the adaptive tau, in [0, 1): 0 = this step's estimate alone.
    sample_ratio: fraction of elements sampled (at least what the estimates need), in (0, 1]."""

    max_ratio: float = 0.01
    adaptive: bool = True
    tau: float | None = None
    quantile: float | None = None
    ema: float = 0.5
    sample_ratio: float = 0.01

    def validate(self):
        for name in ("tau", "quantile"):  # optional floats: an int is not converted for us
            v = getattr(self, name)
            if isinstance(v, int):
                object.__setattr__(self, name, float(v))
        check(0 < self.max_ratio <= 1, "max_ratio", self.max_ratio, "a number in (0, 1]")
        check(self.tau is None or (math.isfinite(self.tau) and self.tau > 0), "tau", self.tau,
              "a finite number > 0 (with adaptive=false), or None")
        check(self.tau is None or not self.adaptive, "tau", self.tau,
              "only with adaptive=false (a fixed threshold); adaptive=true estimates tau "
              "per parameter")
        check(self.adaptive or self.tau is not None, "adaptive", self.adaptive,
              "false only with a fixed tau > 0 given")
        check(self.quantile is None or 0 < self.quantile < 1, "quantile", self.quantile,
              "a number in (0, 1), or None (1 - max_ratio / 2)")
        check(0 <= self.ema < 1, "ema", self.ema, "a number in [0, 1)")
        check(0 < self.sample_ratio <= 1, "sample_ratio", self.sample_ratio, "a number in (0, 1]")

    @property
    def q(self) -> float:
        return self.quantile if self.quantile is not None else 1 - self.max_ratio / 2


def _estimates(y, cap, cfg, seed, adaptive, guarded):
    """(est, guard) from one sample of |y|: the adaptive estimate of step 2 (None when not
    adaptive) and the cap guard of step 3 (None when 2 cap >= n). 0-d fp32 tensors."""
    n = y.numel()
    target = math.ceil(TARGET_FACTOR * cap)
    need = math.ceil(cfg.sample_ratio * n)
    if adaptive:
        need = max(need, math.ceil(MIN_SAMPLE_HITS / (1 - cfg.q)))
    if guarded:
        need = max(need, math.ceil(MIN_SAMPLE_HITS * n / target))
    m = min(n, need)
    g = torch.Generator(device=y.device)
    g.manual_seed(seed)
    s = y[torch.randint(0, n, (m,), generator=g, device=y.device)].abs()
    ks = max(1, min(m, math.ceil((1 - cfg.q) * m))) if adaptive else 0
    kg = max(1, min(m, -(-target * m // n))) if guarded else 0  # as kernels.sample_threshold
    top = torch.topk(s, max(ks, kg), sorted=True).values  # descending
    est = torch.where(top[:ks] > 0, top[:ks], _INF).min() if adaptive else None
    return est, (top[kg - 1] if guarded else None)


@functools.lru_cache(maxsize=64)
def _owner(caps: tuple, device: torch.device) -> torch.Tensor:
    """(sum(caps),) int64: which compressed parameter each code slot belongs to. Cached per
    layout: building it on a GPU each step would copy from the host each step."""
    return torch.repeat_interleave(torch.arange(len(caps)), torch.tensor(caps)).to(device)


@register_method
class Threshold(Compressor):
    Config = ThresholdConfig
    name = "threshold"
    residual_slot = "residual"
    description = "threshold quantization (Strom 2015): elements above tau sent as sign + index"

    def _tau(self, est, name, ctx, device):
        """Step 2's EMA, in place in the parameter's persistent tau."""
        prev = ctx.tensor("tau", name, lambda: torch.full((), _INF, device=device))
        new = torch.where(torch.isinf(prev), est,
                          torch.where(torch.isinf(est), prev, torch.lerp(prev, est, 1 - self.config.ema)))
        return prev.copy_(new)

    def reduce(self, x, ctx):
        big, dense = self.split(ctx.params)
        if not big:
            return self.dense(x, ctx)
        cfg = self.config
        e = self.add_residual(x, ctx)
        fixed = None if cfg.adaptive else torch.full((), cfg.tau, dtype=torch.float32, device=x.device)
        codes, taus, caps = [], [], []
        for p in big:
            y = x[p.offset : p.offset + p.numel]
            n = p.numel
            cap = max(1, math.ceil(cfg.max_ratio * n))
            capacity = min(n, CAPACITY_FACTOR * cap)
            guarded = capacity < n
            est = guard = None
            if cfg.adaptive or guarded:
                est, guard = _estimates(y, cap, cfg, ctx.seed(0, p.name), cfg.adaptive, guarded)
            tau = self._tau(est, p.name, ctx, x.device) if cfg.adaptive else fixed
            thr = torch.nextafter(tau, torch.full_like(tau, _INF))  # |y| > tau  <=>  |y| >= thr
            if guard is not None:
                thr = torch.maximum(thr, guard)
            vals, idx = kernels.select_topk(y, thr, cap, capacity)  # unused slots: value 0
            codes.append(idx.add_(p.offset + 1).mul_(torch.sign(vals).to(torch.int32)))
            taus.append(torch.where(torch.isinf(tau), 0.0, tau))  # +inf: nothing was sent
            caps.append(cap)
        codes = torch.cat(codes)
        taus = torch.stack(taus)
        if ctx.logging:
            ctx.log("threshold", taus.mean())
            ctx.log("sent_fraction", (codes != 0).sum() / sum(p.numel for p in big))
        owner = _owner(tuple(caps), x.device)  # each code slot's parameter: its sender's tau
        pos = codes.abs().sub_(1).clamp_(min=0).long()
        if e is not None:
            e.copy_(x).index_put_((pos,), -torch.sign(codes).float() * taus[owner], accumulate=True)
            zero_dense(e, dense)
        K, P = codes.numel(), len(big)
        msg = torch.cat([codes, taus.view(torch.int32), dense_values(x, dense).view(torch.int32)])
        got = ctx.comm.allgather(msg)  # (W, K + P + dense) int32
        got_codes = got[:, :K]
        sent = torch.sign(got_codes).float() * got[:, K : K + P].contiguous().view(torch.float32)[:, owner]
        out = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        kernels.scatter_add(sent, got_codes.abs().sub_(1).clamp_(min=0), out)
        out.div_(ctx.comm.world_size)
        put_dense(got[:, K + P :], dense, out)
        return out
