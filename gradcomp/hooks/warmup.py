"""The adaptive warm-up: dense (plain fp32 allreduce) until the gradients leave the early
critical regime, then compressed for good. After *Accordion* (Agarwal et al., "Adaptive
Gradient Communication via Critical Learning Regime Identification", MLSys 2021,
arXiv:2010.16248), which detects critical regimes by the relative change of the gradient
norm between epochs.

The rule (``warmup="adaptive"``, what the default ``"auto"`` runs for every compressing method
syncing every step; ``dense_steps=N`` replaces it with exactly N dense steps,
``warmup="none"`` compresses from the first step, and is what ``"auto"`` runs with
``local_steps`` > 1):

  1. Every step, each rank records ||g_p||^2 of its own gradient g for each parameter p
     (g: the hook's input, every bucket, before compression and unscaled; one fused norm
     per bucket, on the device, on the caller's thread: no host sync). A step's value is
     their sum, taken in name order (independent of DDP's bucket layout).
  2. At the first bucket of step t = k * warmup_window (on the caller's thread, before any
     bucket of step t is queued) the window that just ended is finalized: the exchanges
     still in flight are waited for, then ONE allreduce (SUM) of its per-step values over
     every rank, read once by the host. Steps whose sum is not finite (inf/NaN gradients,
     skipped by a GradScaler) are left out. Its norm N_k = sqrt(mean over steps and ranks of
     ||g||^2), identical on every rank.
  3. r_k = |N_k - N_{k-1}| / N_{k-1}. If r_k < warmup_threshold (eta; 0.5 as in Accordion),
     step t and every later step are compressed; otherwise step t is dense and the next
     window is watched. The earliest switch is at 2 windows. ``warmup_max_steps`` > 0 forces
     the switch at that step.

One-way, unlike Accordion (which also goes back to less compression when the norm moves
again, e.g. after a learning-rate decay): error feedback's residuals, DGC's velocities and
PowerSGD's warm-started factors describe an unbroken run of compressed steps; sent dense
for a while they would be stale, or would have to be flushed into a dense step. Once the
switch is made nothing is measured any more (no cost after the warm-up).

Every rank decides alike: the statistic is all-reduced, the decision for step t is made
from completed windows before step t's first exchange, and the collective is issued on the
caller's thread while no exchange is in flight (the same program point on every rank).
With ``local_steps`` > 1 the steps are outer rounds and g the pseudo-gradient.
"""
from __future__ import annotations

import collections
import math

import torch
import torch.distributed as dist

from .. import comm as collectives
from ..comm import Traffic


class Warmup:
    """A component of the state: when a compressing method's steps start to compress (the
    rule above). ``stateless``: the method never compresses (plain allreduce)."""

    def __init__(self, config, stateless: bool):
        self.config, self.stateless = config, stateless
        self._entries: list = []  # (step, parameter names, their ||g_p||^2) of this window
        self._next = config.warmup_window  # the step at which the current window ends
        self._prev: float | None = None   # N of the last finalized window
        self.ratio: float | None = None   # r of the last finalized window
        self._switch: int | None = None   # the first compressed step, once decided

    @property
    def watching(self) -> bool:
        """Whether the adaptive rule is still measuring."""
        c = self.config
        return (not self.stateless and c.dense_steps is None
                and c.warmup_rule == "adaptive" and self._switch is None)

    def dense(self, step: int) -> bool:
        """Whether step ``step`` of a stateful method goes as a plain fp32 allreduce."""
        c = self.config
        if c.dense_steps is not None:
            return step < c.dense_steps
        if c.warmup_rule == "none":
            return False
        return self._switch is None or step < self._switch

    def compressing(self, step: int) -> bool | None:
        """Whether step ``step`` is compressed (None: the method never compresses)."""
        return None if self.stateless else not self.dense(step)

    def switch_step(self) -> int | None:
        """The first compressed step (None: not yet known, or never: plain allreduce)."""
        c = self.config
        if self.stateless:
            return None
        if c.dense_steps is not None:
            return c.dense_steps
        return 0 if c.warmup_rule == "none" else self._switch

    def observe(self, step: int, x: torch.Tensor, params, scale=None) -> None:
        """Record ||x_p||^2 of each parameter p in ``params`` (x: a bucket of this rank's
        gradient at ``step``). Kept per parameter, not per bucket, and summed in name order
        at the window's end: the statistic does not depend on DDP's bucket layout (which
        differs between a job and its resumption), so a resumed job decides bit-exactly
        alike."""
        if not self.watching or not params:
            return
        views = [x[p.offset : p.offset + p.numel] for p in params]
        sq = torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).double().square()
        if scale is not None:
            sq = sq / scale.double().square()
        self._entries.append((step, [p.name for p in params], sq))

    def redo(self, step: int) -> None:
        """Step ``step`` runs again (its gradients were not finite): forget what it added."""
        self._entries = [e for e in self._entries if e[0] != step]

    def begin(self, step: int, sum_over_ranks, log) -> None:
        """At step ``step``'s first bucket: finalize a window that just ended, decide.
        ``sum_over_ranks(acc, step)`` sums the window's per-step values over every rank in
        place (the one collective, issued by the state in its order) and returns how many
        ranks; ``log(step, key, value)`` records a scalar."""
        if not self.watching:
            return
        c = self.config
        if step >= self._next:
            self._next += c.warmup_window
            self._finalize(step, sum_over_ranks, log)
        if self._switch is None and c.warmup_max_steps and step >= c.warmup_max_steps:
            self._switch = step

    def _finalize(self, step: int, sum_over_ranks, log) -> None:
        entries, self._entries = self._entries, []
        W = self.config.warmup_window
        device = entries[-1][2].device if entries else torch.device("cpu")
        acc = torch.zeros(W, dtype=torch.float64, device=device)
        if entries:  # per step, the sum over parameters in name order
            keys = [(s, n) for s, names, _ in entries for n in names]
            order = sorted(range(len(keys)), key=keys.__getitem__)
            vals = torch.cat([sq.to(device) for _, _, sq in entries])
            vals = vals[torch.tensor(order, device=device)]
            count = collections.Counter(s for s, _ in keys)
            steps = sorted(count)
            for s, part in zip(steps, torch.split(vals, [count[s] for s in steps])):
                acc[s % W] = part.sum()
        world = sum_over_ranks(acc, step)
        vals = acc.cpu()  # the one host read of the window
        vals = vals[torch.isfinite(vals)]
        if not vals.numel():  # every step of the window was skipped
            return
        norm = math.sqrt(float(vals.mean()) / world)
        prev, self._prev = self._prev, norm
        log(step, "warmup_grad_norm", norm)
        if prev is None:
            return
        ratio = abs(norm - prev) / prev if prev > 0 else (0.0 if norm == 0 else math.inf)
        self.ratio = ratio
        log(step, "warmup_norm_change", ratio)
        if ratio < self.config.warmup_threshold:
            self._switch = step

    def state_dict(self) -> dict:
        return {"entries": [(s, list(names), sq.cpu().clone()) for s, names, sq in self._entries],
                "next": self._next, "prev": self._prev, "ratio": self.ratio,
                "switch": self._switch}

    def load_state_dict(self, sd: dict | None) -> None:
        self.__init__(self.config, self.stateless)
        if sd is None:  # a checkpoint from before the adaptive warm-up
            return
        self._entries = [(s, list(names), sq.clone()) for s, names, sq in sd["entries"]]
        self._next, self._prev = sd["next"], sd["prev"]
        self.ratio, self._switch = sd["ratio"], sd["switch"]


def window_sum(acc: torch.Tensor, step: int, *, drain, group, telemetry) -> int:
    """The warm-up's one collective: its window's values summed over every rank of
    ``group`` (under HSDP the whole mesh, so the job switches at one step), issued after
    ``drain()`` while no exchange is in flight (the same program point on every rank), its
    bytes counted in ``telemetry``. Returns how many ranks."""
    drain()
    world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    if world > 1:
        t = Traffic()
        collectives.all_reduce_now(acc, "sum", group, traffic=t)
        telemetry.add(step, t)
    return world
