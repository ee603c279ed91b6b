"""Collectives used by the compressors, with per-step byte accounting.

With no process group (world size 1) every collective is the identity, so the algorithms run
and are tested in a single process. Calls are blocking: the hook runs them on its own
communication thread, never on the thread that runs backward.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class Traffic:
    """Bytes of one step. ``sent``: bytes of the messages this rank handed to collectives.
    ``wire``: bytes a bandwidth-optimal implementation puts on this rank's link (ring
    allreduce 2(W-1)/W, allgather (W-1), all-to-all (W-1)/W times the message)."""

    __slots__ = ("sent", "wire", "collectives", "comm_s", "total_s")

    def __init__(self):
        self.sent = 0
        self.wire = 0.0
        self.collectives = 0
        self.comm_s = 0.0   # wall time inside collectives
        self.total_s = 0.0  # wall time of whole exchanges (compress + collectives + decompress)

    def merge(self, other: "Traffic") -> None:
        for k in self.__slots__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def add(self, nbytes: int, wire_factor: float) -> None:
        self.sent += nbytes
        self.wire += nbytes * wire_factor
        self.collectives += 1


class Comm:
    def __init__(self, group=None, traffic: Traffic | None = None):
        self.group = group
        self.distributed = group is not None
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.traffic = traffic if traffic is not None else Traffic()

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        W = self.world_size
        self.traffic.add(t.numel() * t.element_size(), 2 * (W - 1) / W)
        if W > 1:
            t0 = time.perf_counter()
            dist.all_reduce(t, op=_OPS[op], group=self.group)
            self.traffic.comm_s += time.perf_counter() - t0
        return t

    def any_async(self, flag: bool, device) -> "callable":
        """Start an OR over ranks of ``flag``; returns ``wait() -> bool``. Runs beside the
        collectives issued after it, so its latency hides behind theirs."""
        W = self.world_size
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        self.traffic.add(4, 2 * (W - 1) / W)
        if W == 1:
            return lambda: bool(flag)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

        def wait() -> bool:
            t0 = time.perf_counter()
            work.wait()
            self.traffic.comm_s += time.perf_counter() - t0
            return bool(t.item())
        return wait

    def allgather(self, t: torch.Tensor) -> torch.Tensor:
        """(W, *t.shape): every rank's t, in rank order."""
        W = self.world_size
        self.traffic.add(t.numel() * t.element_size(), W - 1)
        out = torch.empty((W, *t.shape), dtype=t.dtype, device=t.device)
        if W > 1:
            t0 = time.perf_counter()
            dist.all_gather(list(out.unbind(0)), t.contiguous(), group=self.group)
            self.traffic.comm_s += time.perf_counter() - t0
        else:
            out[0].copy_(t)
        return out

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """t: (W, ...); row j goes to rank j. Returns (W, ...): row i came from rank i."""
        W = self.world_size
        if t.shape[0] != W:
            raise ValueError(f"all_to_all needs {W} rows, got {t.shape[0]}")
        self.traffic.add(t.numel() * t.element_size(), (W - 1) / W)
        if W == 1:
            return t.clone()
        out = torch.empty_like(t)
        t0 = time.perf_counter()
        dist.all_to_all_single(out, t.contiguous(), group=self.group)
        self.traffic.comm_s += time.perf_counter() - t0
        return out
