"""The inf/NaN guard: a step whose gradients hold inf/NaN on any rank leaves every method's
memory as it was and gives every rank inf/NaN (a GradScaler then skips the step everywhere,
and training goes on as if it never happened).

Its flag is all-reduced beside each exchange's first collective. Without ``delay`` or local
steps the host reads it a step late (:meth:`Guard.settle`, at the next step's first bucket):
nothing in a step waits for the device. The exchange commits its memory at once, keeping
what undoes it; a flagged bucket's result becomes NaN on the device; the next step's start
reads the step's flags (long landed) and undoes the memory of a skipped step's buckets. With
``delay`` or local steps the exchange runs beside later steps, and reads its flag when its
last collective is over."""
from __future__ import annotations

import threading

import torch

from .. import kernels
from ..kernels.host import read_later, to_device, to_host_later

STEP_MOD = 2**24  # steps travel as float32: exact below this


def step_flag(bad: torch.Tensor, step: int) -> torch.Tensor:
    """The flag a rank sends: (non-finite?, s, -s) for its step s; MAX over ranks gives
    (any non-finite, the highest step, minus the lowest)."""
    s = float(step % STEP_MOD)
    return torch.cat([bad, to_device([s, -s], torch.float32, bad.device)])


def clear_flag(step: int, device) -> torch.Tensor:
    """:func:`step_flag` of a finite bucket: (0, s, -s), one copy to the device."""
    s = float(step % STEP_MOD)
    return to_device([0.0, s, -s], torch.float32, device)


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
        # the exchanges of the current step, with what undoes them, until the step is decided
        # (:meth:`settle`): (step, snapshot, names, [(slot, bucket, buffer before)], the
        # flag's host copy to read then, or None where it was read already)
        self._held: list = []
        self._lock = threading.Lock()
        # ``late``: each bucket's two flags on its device, [the next exchange's, the other]:
        # an exchange's finite_copy writes its flag whole but for [0], which the previous
        # exchange's flag_fill zeroed (the flags are the device's own: no copy from the host)
        self._flags: dict = {}

    def __getstate__(self):
        self.settle()
        d = self.__dict__.copy()
        d.pop("_lock")
        d["_flags"] = {}
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def _late_flags(self, bucket: int, device) -> list:
        """Bucket ``bucket``'s pair of flags (made zero on its first exchange). A bucket's
        exchanges run in order on one lane (one stream): the flag zeroed by one exchange's
        flag_fill is written by the next one's finite_copy, after the other's host copy."""
        key = (bucket, torch.device(device))
        with self._lock:
            pair = self._flags.get(key)
            if pair is None:
                pair = self._flags[key] = [torch.zeros(3, device=device),
                                           torch.zeros(3, device=device)]
        return pair

    def settle(self) -> None:
        """The step's exchanges are over (the next step begins, a checkpoint is taken, the
        state closes): their flags not read yet are read (the step check raises here, on
        every rank alike); if the step was skipped, the memory of every bucket of it is put
        back, not only the bucket that held the inf/NaN, so the step leaves no trace in any
        bucket's memory; then their copies are released."""
        with self._lock:
            held, self._held = self._held, []
        try:
            for step, _, _, _, flag in held:
                if flag is not None and check_steps(read_later(flag)):
                    self.skipped = step
        finally:
            for step, snap, names, swaps, _ in held:
                if step == self.skipped:
                    self.memory.restore(snap, names)
                    for slot, bucket, before in swaps:
                        self.memory.revert(slot, bucket, before)
                self.memory.release(snap)

    def run(self, x, ctx, flat, run, late: bool = False):
        """Reduce with inf/NaN protection. Whether any rank's bucket holds a non-finite value
        travels beside the exchange (a flag all-reduced with its first collective); if one
        does, the step is garbage (a GradScaler skips it): the memory of the bucket's
        parameters is put back as it was, not poisoned for the rest of training, and every
        rank gets inf/NaN (``late`` below says where).

        Host reads: none before the exchange (the check stays on the device; the compressor
        gets x with inf/NaN put to 0: with ``late`` x itself, else a copy for the fallback); the flag's,
        after the exchange's last collective, or with ``late`` a step later. The CPU takes
        the same path, so the host reads counted there are the GPU's
        (tests/test_host_reads.py).

        ``run(x)`` is the whole exchange (under a hierarchical topology: the node's
        reduce-scatter, the compressed exchange of this rank's shard, the allgather);
        ``flat`` the lane's comm over every rank: the flag and the fallback go over it, so
        every rank decides alike whatever shard holds the bad values.

        The flag also carries the step index (s, -s): ranks whose states are at different
        steps (one rank's state built anew) all raise where the flag is read (that exchange,
        or with ``late`` the next step's start), instead of training on with memories that
        do not belong together.

        ``late`` (no delay: every exchange of a step, or of an outer round with local steps,
        is over before the next one's first bucket): the flag is read a step late by
        :meth:`settle`, no host read here. The memory is committed, kept undoable until :meth:`settle` decides the step
        (another bucket of it may hold the inf/NaN), and where the flag is up the result is
        NaN throughout the bucket on every rank (the step's garbage either way). Otherwise a
        flagged bucket's result is the allreduce of the ranks' own gradients (inf/NaN where
        a plain allreduce has them) and its memory is put back at once."""
        names = [p.name for p in ctx.params]
        # the per-parameter tensors now; each flat slot as the exchange first asks for it to
        # write (ctx.memory); a slot it rewrites whole (ctx.memory_next) is not copied at all:
        # its new buffer is committed or dropped below
        snap = ctx.snapshot = self.memory.snapshot(names, ctx.bucket, slots=())
        if late:
            return self._run_late(x, ctx, flat, run, snap, names)
        orig = x  # the compressor runs on every rank alike (the same collectives)
        # the step check rides with the flag; the copy without inf/NaN sets bad[0] (one
        # kernel on a GPU)
        bad = clear_flag(ctx.step, x.device)
        x = kernels.finite_copy(x, bad)
        flat.flag(bad)
        try:
            out = run(x)
            flagged = check_steps(flat.flag_result(bad))
        except BaseException:
            self._undo(snap, names, ctx)
            raise
        finally:
            ctx.snapshot = None
        ctx.finish(not flagged)
        if not flagged:
            self.memory.release(snap)
            return out
        self.memory.restore(snap, names)
        self.memory.release(snap)
        self.skipped = ctx.step
        return flat.allreduce(orig).div_(flat.world_size)

    def _undo(self, snap, names, ctx) -> None:
        """An exchange that raised leaves the memory as it was: what it wrote in place put
        back, its new buffers dropped (a method may write a slot before its last
        collective: PowerSGD's Q's)."""
        try:
            self.memory.restore(snap, names)
            self.memory.release(snap)
        finally:
            ctx.finish(False)

    def _run_late(self, x, ctx, flat, run, snap, names):
        """:meth:`run` with ``late``: the flag goes to the host while the step goes on. The
        copy without inf/NaN is x itself, as nothing falls back to x (the bucket's result
        replaces it, and the compressor's result is often x itself: no copy back); the same
        kernel writes the step into the bucket's flag."""
        pair = self._late_flags(ctx.bucket, x.device)
        bad = pair[0]
        x = kernels.finite_copy(x, bad, out=x, step=float(ctx.step % STEP_MOD))
        flat.flag(bad)
        # the compressor's last kernel may write the verdict (ctx.verdict): the other flag
        # is the next exchange's, zeroed by whichever kernel writes it
        ctx.verdict_offer, ctx.verdict_taken = (flat, bad, pair[1]), None
        try:
            out = run(x)
            flat.flag_done(bad)
        except BaseException:
            with self._lock:  # its flags stay as they are: the bucket's next pair starts at 0
                self._flags.pop((ctx.bucket, bad.device), None)
            self._undo(snap, names, ctx)
            raise
        finally:
            ctx.snapshot = ctx.verdict_offer = None
        swaps = [(slot, ctx.bucket, before) for slot, before in ctx.replaced()]
        ctx.finish(True)
        with self._lock:
            self._held.append((ctx.step, snap, names, swaps, to_host_later(bad)))
            pair.reverse()
        if ctx.verdict_taken is out:
            return out
        try:
            return kernels.flag_fill(out, bad, clear=pair[0])
        except BaseException:
            with self._lock:  # the next flag was not zeroed: the bucket's next pair starts at 0
                self._flags.pop((ctx.bucket, bad.device), None)
            raise
