"""Threshold quantization with error feedback (Strom, "Scalable Distributed DNN Training Using
Commodity GPU Cloud Computing", Interspeech 2015).

Algorithm, per parameter of n >= ``min_numel`` elements and step (smaller parameters go as
plain fp32 values inside the same message); cap = ceil(max_ratio * n):
  1. y = g + e (error feedback).
  2. tau: fixed (``adaptive=false, tau=T``, Strom's setting), or adaptive (the default: a
     fixed tau depends on the model's gradient scale, which changes by orders of magnitude
     between models, layers and phases of training). Adaptive rule, per parameter and rank:
       est_t = the smallest non-zero value among the ceil((1 - quantile) * m) largest |y| of
               m sampled elements (a Weyl sequence shifted at random per parameter and
               step, see kernels/segmented.py), i.e. the ``quantile`` of |y| with zeros
               skipped (+inf if every sampled |y| is 0);
       tau_t = est_t at the first estimate, tau_{t-1} if est_t is +inf, else
               ema * tau_{t-1} + (1 - ema) * est_t   (torch.lerp, fp32).
     tau_t is kept per parameter in the memory slot ``tau`` (one value per parameter; 0 = no
     estimate yet), so it is in the checkpoint and a resumed job is bit-exact. ``quantile`` defaults to
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
Every step above runs for all of a bucket's parameters at once (kernels/segmented.py: a
fixed number of ops whatever the parameter count).
Bytes per rank: 4 cap + 4 per compressed parameter (+ 4 per dense element): half of top-k's
8k for the same k. Every rank receives (W - 1) times that (allgather).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import kernels
from ..config import MethodConfig, RESIDUAL, TAU, check
from ..kernels import segmented
from ..kernels.host import to_device
from ..kernels.segmented import CAPACITY_FACTOR, MIN_SAMPLE_HITS, TARGET_FACTOR
from .base import Compressor, positions, register_method
from .wire import DENSE, Field, Message



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
        f32 = torch.finfo(torch.float32)
        check(self.tau is None or f32.tiny <= self.tau <= f32.max, "tau", self.tau,
              f"a finite number > 0 (with adaptive=false; at least {f32.tiny:.3g} and at most "
              f"{f32.max:.3g}: a float32 the codec can hold), or None")
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


def _budget(n: int, cfg) -> tuple[tuple, int]:
    """((k, capacity, sample size m, guard rank kg), estimate rank ks) of a parameter of n
    elements: cap = k = ceil(max_ratio * n) elements at most; the sample feeds the adaptive
    estimate (rank ks, 0 when not adaptive) and the cap guard (rank kg, 0 when 2 cap >= n)."""
    cap = min(n, max(1, math.ceil(cfg.max_ratio * n)))
    capacity = min(n, CAPACITY_FACTOR * cap)
    guarded = capacity < n
    target = math.ceil(TARGET_FACTOR * cap)
    need = math.ceil(cfg.sample_ratio * n)
    if cfg.adaptive:
        need = max(need, math.ceil(MIN_SAMPLE_HITS / (1 - cfg.q)))
    if guarded:
        need = max(need, math.ceil(MIN_SAMPLE_HITS * n / target))
    m = min(n, need) if cfg.adaptive or guarded else 0
    ks = max(1, min(m, math.ceil((1 - cfg.q) * m))) if cfg.adaptive and m else 0
    kg = max(1, min(m, -(-target * m // n))) if guarded else 0  # as topk's sampled threshold
    return (cap, capacity, m, kg), ks


@dataclass(frozen=True)
class _Tables:
    """A bucket's tables (built once per layout and config)."""

    plan: segmented.SelectPlan
    big: tuple               # the compressed parameters' places in ctx.params, offset order
    where: torch.Tensor      # the same, as a tensor
    est_end: torch.Tensor    # (P,) first sample after each parameter's estimate rank ...
    est_start: torch.Tensor  # (P,) ... its first sample
    zero_key: torch.Tensor   # (P,) the sort key of a 0 magnitude of each parameter
    owner: torch.Tensor      # (K,) the parameter of each code slot
    seg_param: torch.Tensor  # (S,) each segment's parameter (0 for a gap: its NaN wins)


@functools.lru_cache(maxsize=64)
def _tables(layout: tuple, n: int, cfg, device) -> _Tables:
    """layout: (offset, numel, size) of every parameter of the bucket, in ctx.params order."""
    big = tuple(sorted((i for i, (_, _, size) in enumerate(layout) if size >= cfg.min_numel),
                       key=lambda i: layout[i][0]))
    budgets, ranks = zip(*(_budget(layout[i][1], cfg) for i in big)) if big else ((), ())
    pl = segmented.plan(tuple(layout[i][:2] for i in big), budgets, n, device)
    starts = pl.sample_start.tolist()
    seg_param = [0] * pl.seg_thr.numel()
    for p, s in enumerate(pl.param_seg.tolist()):
        seg_param[s] = p

    def t(v):
        return torch.tensor(v, dtype=torch.int64, device=device)

    return _Tables(pl, big, t(list(big)), t([a + k for a, k in zip(starts, ranks)]), t(starts),
                   t([(p << 31) + 0x7FFFFFFF for p in range(len(big))]),
                   t([p for p, b in enumerate(budgets) for _ in range(b[0])]), t(seg_param))


MESSAGE = Message(
    "every rank's sent elements, all-gathered",
    Field("codes", torch.int32, "K", "sign(value) x (its place in the bucket + 1) for each "
          "element above its parameter's threshold; 0 for an unused slot"),
    Field("taus", torch.float32, "P", "each compressed parameter's threshold: every sent "
          "element of it stands for +-tau"),
    DENSE,
    note="`K`: the fixed number of slots (each parameter's `max_ratio` of its elements), so "
         "the message's size is known without a host read; `P`: the compressed parameters.")


@register_method
class Threshold(Compressor):
    Config = ThresholdConfig
    name = "threshold"
    residual_slot = RESIDUAL
    scalar_slots = ("tau",)
    # (Compressor.measured) AdamW: "freeze" measured with the fp32 warm-up, 1 seed
    measured = {"sgd_points": -2.4, "adamw_gap_pct": {"freeze": 14.0, "momentum": 5.35}}
    description = "threshold quantization (Strom 2015): elements above tau sent as sign + index"
    messages = (MESSAGE,)

    def exchange(self, x, ctx, big, dense):
        cfg = self.config
        tb = _tables(tuple((p.offset, p.numel, p.size if self.big(p.name, p.size) else -1)
                           for p in ctx.params), x.numel(), cfg,
                     x.device)
        pl = tb.plan
        params = [ctx.params[i] for i in tb.big]
        shifts = to_device([segmented.shift(ctx.seed(0, p.name), p.numel) for p in params],
                           torch.int64, x.device)
        # the message, written in place by the kernels below: codes, taus, dense values
        K, P, at = tb.owner.numel(), len(params), positions(
            tuple((p.offset, p.numel) for p in dense), x.device)
        lay = MESSAGE.bind(K=K, P=P, n_dense=at.numel())
        msg = torch.empty(lay.nbytes, dtype=torch.uint8, device=x.device)
        # step 2 (see the module docstring): the sample sorted by (parameter, |y| descending);
        # zeros sort last within a parameter, so the estimate counts the non-zero ones; the
        # cap guard raises each threshold (gaps: NaN)
        # y = x + e (error feedback; the next residual's buffer) in the sampler's launch
        e, y = ctx.memory_next(RESIDUAL) if cfg.error_feedback else (None, x)
        keys, mag = kernels.threshold_sample(x, e, y, pl.sample_base, pl.sample_of, shifts,
                                             pl.sample_n, pl.sample_off, pl.sample_key, pl.tail)
        keys, order = torch.sort(keys)
        taus = ctx.scalars(TAU) if cfg.adaptive else None  # per parameter; 0: none yet
        sent_tau, thr = kernels.threshold_tau(keys, order, mag, tb.zero_key, tb.est_start,
                                              tb.est_end, taus, tb.where, pl.seg_thr,
                                              tb.seg_param, pl.param_seg, cfg.tau, cfg.ema,
                                              lay.unpack(msg)["taus"])
        vals, idx = segmented.select_above(y, pl, thr)  # unused slots: value 0
        # y less what is sent (sign * tau at each sent index), 0 at the dense parameters,
        # in the encoder's pass, which writes the codes and the dense values of x
        codes = kernels.threshold_encode(vals, idx, tb.owner, sent_tau, y if y is not x else None,
                                         x, at, msg.view(torch.int32))
        if ctx.logging:
            ctx.log("threshold", sent_tau.mean())
            ctx.log("sent_fraction", (codes != 0).sum() / sum(p.numel for p in params))
        raw = ctx.comm.allgather(msg)  # (W, bytes)
        out = x.zero_()  # x is not read again (the message holds what was sent)
        # the decoder reads every row in place: its codes and taus, and sums its dense values
        kernels.threshold_decode(raw.view(torch.int32), K, P, tb.owner, out, at)
        return out.div_(ctx.comm.world_size)
