"""The inf/NaN guard: a step whose gradients hold inf/NaN on any rank leaves every method's
memory as it was and gives every rank the inf/NaN a plain allreduce would (a GradScaler then
skips the step everywhere, and training goes on as if it never happened)."""
from __future__ import annotations

import threading

import torch

from ..kernels.host import to_device

STEP_MOD = 2**24  # steps travel as float32: exact below this


def step_flag(bad: torch.Tensor, step: int) -> torch.Tensor:
    """The flag a rank sends: (non-finite?, s, -s) for its step s; MAX over ranks gives
    (any non-finite, the highest step, minus the lowest)."""
    s = float(step % STEP_MOD)
    return torch.cat([bad, to_device([s, -s], torch.float32, bad.device)])


def check_steps(vals) -> bool:
    """Raise (on every rank alike: they all read the same reduced flag) if the ranks' steps
    differ; return whether any rank's gradients were not finite."""
    flagged, hi, neg_lo = vals
    if hi != -neg_lo:
        raise RuntimeError(
            f"gradcomp: the ranks are at different steps of this state (from step "
            f"{-neg_lo:.0f} to {hi:.0f}, mod 2**24): a checkpoint was loaded on some ranks "
            f"only, or ranks loaded checkpoints of different steps, or one rank's state was "
            f"built anew; every rank must load its own state_dict() of the same step")
    return bool(flagged > 0)


class Guard:
    """A component of the state: ``run`` wraps a stateful compressor's exchange; ``skipped``
    is the index of the latest step whose gradients were not finite on some rank (None
    until one was)."""

    def __init__(self, memory):
        self.memory = memory
        self.skipped: int | None = None
        # the finite exchanges of the current step, with what undoes them, until the step
        # is decided (:meth:`settle`): (step, snapshot, names, [(slot, bucket, buffer before)])
        self._held: list = []
        self._lock = threading.Lock()

    def __getstate__(self):
        self.settle()
        d = self.__dict__.copy()
        d.pop("_lock")
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def settle(self) -> None:
        """The step's exchanges are over (the next step begins, a checkpoint is taken, the
        state closes): if it was skipped, the memory of every bucket that was finite is put
        back too, not only the bucket that held the inf/NaN (its own was put back at once),
        so the step leaves no trace in any bucket's memory; then their copies are released."""
        with self._lock:
            held, self._held = self._held, []
        for step, snap, names, swaps in held:
            if step == self.skipped:
                self.memory.restore(snap, names)
                for slot, bucket, before in swaps:
                    self.memory.revert(slot, bucket, before)
            self.memory.release(snap)

    def run(self, x, ctx, flat, run, hold: bool = False):
        """Reduce with inf/NaN protection. Whether any rank's bucket holds a non-finite value
        travels beside the exchange (a flag all-reduced with its first collective); if one
        does, the step is garbage (a GradScaler skips it): the memory of the bucket's
        parameters is put back as it was, not poisoned for the rest of training, and the
        result is an allreduce of the non-finite ranks' gradients (the others add zeros), so
        every rank gets inf/NaN at exactly the positions a plain allreduce would give them.

        Host reads: none before the exchange (the local check stays on the device, the
        compressor gets a finite copy, the original is kept for the fallback) and one, of
        the flag, after the exchange's last collective. The CPU takes the same path, so the
        host reads counted there are the GPU's (tests/test_host_reads.py).

        ``run(x)`` is the whole exchange (under a hierarchical topology: the node's
        reduce-scatter, the compressed exchange of this rank's shard, the allgather);
        ``flat`` the lane's comm over every rank: the flag and the fallback go over it, so
        every rank decides alike whatever shard holds the bad values.

        The flag also carries the step index (s, -s): ranks whose states are at different
        steps (a checkpoint loaded on one rank only) all raise at that exchange, the first
        after the load, instead of training on with memories that do not belong together.

        ``hold``: a GradScaler skips the step and its index is taken again (DDP without
        delay or local steps): a finite bucket's exchange keeps what undoes it until
        :meth:`settle` decides the step, as another bucket of the same step may still hold
        inf/NaN."""
        names = [p.name for p in ctx.params]
        # the per-parameter tensors now; each flat slot as the exchange first asks for it to
        # write (ctx.memory); a slot it rewrites whole (ctx.memory_next) is not copied at all:
        # its new buffer is committed or dropped below
        snap = ctx.snapshot = self.memory.snapshot(names, ctx.bucket, slots=())
        orig = x  # the compressor runs on every rank alike (the same collectives), on a copy
        bad = torch.isfinite(x).all().logical_not().float().reshape(1)
        x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        bad = step_flag(bad, ctx.step)  # the step check rides with the flag
        flat.flag(bad)
        try:
            out = run(x)
            flagged = check_steps(flat.flag_result(bad))
        except BaseException:
            ctx.finish(False)
            raise
        finally:
            ctx.snapshot = None
        swaps = [(slot, ctx.bucket, before) for slot, before in ctx.replaced()]
        ctx.finish(not flagged)
        if not flagged:
            if hold:
                with self._lock:
                    self._held.append((ctx.step, snap, names, swaps))
            else:
                self.memory.release(snap)
            return out
        self.memory.restore(snap, names)
        self.memory.release(snap)
        self.skipped = ctx.step
        return flat.allreduce(orig).div_(flat.world_size)
