"""A bucket's context at one step: what a compressor sees of it (the ``BucketContext`` of
compressors/base.py), backed by the state's memory and telemetry."""
from __future__ import annotations

import zlib

import torch

from ..comm import Comm
from ..compressors.base import ParamSlice

_MIX = 0x9E3779B97F4A7C15


def mix(*parts: int) -> int:
    """A 63-bit hash of integers (a seed per step, parameter, rank and stream)."""
    h = 0
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFFFFFF)) * _MIX + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    return h >> 1


class BucketCtx:
    """BucketContext for one bucket at one step (see compressors.base.BucketContext)."""

    def __init__(self, stages, comm: Comm, bucket: int, params: list[ParamSlice],
                 param_tensors, device, step: int, live=None):
        """``stages``: the bucket's :class:`hooks.stages.Stages` (its memory, telemetry,
        warm-up and config back the context)."""
        self.stages, self.bucket, self.params = stages, bucket, params
        self.comm, self.step, self.device, self.live = comm, step, device, live
        self.grad_dtype = torch.float32  # the gradient's own dtype (set by stages.split)
        self.dense_wire = None  # a dense step's wire, "bfloat16", "int8" or "int4" (stages.method)
        self.logging = stages.telemetry.logging
        self.details = self.logging and stages.telemetry.details
        self._tensors = param_tensors
        self.snapshot = None  # the inf/NaN guard's, while it runs the exchange
        self._next = {}       # slot -> (current, next) of memory_next, until finish()
        # the guard's verdict while it may be taken: (the comm its flag rides on, the flag,
        # the other flag); then the result it was written into (see :meth:`verdict`)
        self.verdict_offer = None
        self.verdict_taken = None

    @property
    def compressed(self) -> int:
        """Compressed steps before this one: the step less the warm-up's switch (0 while the
        switch is not known). The switch is in the checkpoint: a resumed job counts alike."""
        switch = self.stages.warmup.switch_step()
        return 0 if switch is None else max(self.step - switch, 0)

    def memory(self, slot):
        buf = self.stages.memory.flat(slot, self.bucket, [p.name for p in self.params],
                                     [p.numel for p in self.params], self.device)
        if self.snapshot is not None:  # the guard's: copied before its first write
            self.stages.memory.cover(self.snapshot, slot)
        return buf

    def memory_next(self, slot):
        hit = self._next.get(slot)
        if hit is None:
            hit = self._next[slot] = self.stages.memory.next_flat(
                slot, self.bucket, [p.name for p in self.params], [p.numel for p in self.params],
                self.device)
        return hit

    def verdict(self, out):
        """(flag, clear) for a last kernel that writes every element of ``out``, the
        exchange's result: it writes NaN throughout where flag[0] > 0 and zeroes clear[0]
        (kernels.flag_fill's work, which the guard then leaves out); None where the guard
        offers none. Call it after the exchange's last collective (the flag has landed)."""
        offer, self.verdict_offer = self.verdict_offer, None
        if offer is None:
            return None
        comm, flag, clear = offer
        comm.flag_done(flag)
        self.verdict_taken = out
        return flag, clear

    def replaced(self) -> list:
        """(slot, its buffer now) for each slot :meth:`memory_next` will replace at
        :meth:`finish`: what puts the memory back after a commit (the guard's)."""
        return [(slot, cur) for slot, (cur, _) in self._next.items()]

    def finish(self, ok: bool) -> None:
        """The exchange is over: the buffers of :meth:`memory_next` become the memory (ok) or
        go back unused (the step is dropped)."""
        pending, self._next = self._next, {}
        for slot, (_, nxt) in pending.items():
            if ok:
                self.stages.memory.commit(slot, self.bucket, nxt)
            else:
                self.stages.memory.discard(slot, self.bucket, nxt)

    def scalars(self, slot):
        buf = self.stages.memory.flat(slot, self.bucket, [p.name for p in self.params],
                                     [1] * len(self.params), self.device)
        if self.snapshot is not None:
            self.stages.memory.cover(self.snapshot, slot)
        return buf

    def tensor(self, slot, name, init):
        return self.stages.memory.tensor(slot, name, init)

    def segment_ids(self):
        return torch.repeat_interleave(
            torch.arange(len(self.params), device=self.device),
            torch.tensor([p.numel for p in self.params], device=self.device))

    def param_values(self):
        if self._tensors is None:
            raise RuntimeError("this bucket was reduced without its parameters")
        return torch.cat([t.detach().reshape(-1).float() for t in self._tensors])

    def seed(self, stream, name):
        return mix(self.stages.config.seed, self.step, zlib.crc32(name.encode()), self.comm.rank,
                    stream)

    def log(self, key, value):
        self.stages.telemetry.log(self.step, key, value)  # (nothing without a writer)
