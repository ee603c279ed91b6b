"""Collectives used by the compressors, with per-step byte accounting; the one module of
the library that calls torch.distributed's collectives (tests/test_design.py checks it).

With no process group (world size 1) every collective is the identity, so the algorithms run
and are tested in a single process. Calls block the calling lane (never the thread that
runs backward); the issue itself is asynchronous and ordered by the engine's ticket
(hooks/engine.py).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class _Done:
    def wait(self) -> None:
        pass


_DONE = _Done()


class Traffic:
    """Bytes of one step. ``sent``: bytes of the messages this rank handed to collectives.
    ``wire``: bytes a bandwidth-optimal implementation puts on this rank's link (ring
    allreduce 2(W-1)/W, allgather (W-1), all-to-all (W-1)/W times the message)."""

    __slots__ = ("sent", "wire", "intra", "collectives", "comm_s", "total_s", "comm_cpu_s",
                 "total_cpu_s")

    def __init__(self):
        self.sent = 0
        self.wire = 0.0
        self.intra = 0.0    # the part of ``wire`` that stays inside a node (hierarchical)
        self.collectives = 0
        self.comm_s = 0.0   # wall time inside collectives
        self.total_s = 0.0  # wall time of whole exchanges (compress + collectives + decompress)
        # the same two spans in the exchanging thread's CPU time (time.thread_time): what the
        # exchange took from the cores, where wall time also counts waiting for them
        self.comm_cpu_s = 0.0
        self.total_cpu_s = 0.0

    def merge(self, other: "Traffic") -> None:
        for k in self.__slots__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def add(self, nbytes: int, wire_factor: float, intra: bool = False) -> None:
        self.sent += nbytes
        self.wire += nbytes * wire_factor
        if intra:
            self.intra += nbytes * wire_factor
        self.collectives += 1


class Rider:
    """One exchange's inf/NaN flag: all-reduced (MAX) over ``group`` (every rank of the
    job) asynchronously, in the turn of the exchange's first collective, whichever of the
    lane's comms issues it; read once after the exchange's last collective."""

    def __init__(self, group):
        self.group = group
        self.tensor: torch.Tensor | None = None
        self.work = None


class Comm:
    """Collectives of one lane. With a ``ticket`` (set per exchange by the engine) each
    collective is issued asynchronously in its turn of the global order and waited for after
    the turn is given up; without one (a single thread: ``Entries.reduce``) it is
    issued at once."""

    def __init__(self, group=None, traffic: Traffic | None = None, rider: Rider | None = None,
                 intra: bool = False):
        self.group = group
        self.distributed = group is not None
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.traffic = traffic if traffic is not None else Traffic()
        self.ticket = None
        self.rider = rider if rider is not None else Rider(group)  # shared by a lane's comms
        self.intra = intra  # a node's own group: its bytes stay inside the node

    def _count(self, t: torch.Tensor, factor: float) -> None:
        self.traffic.add(t.numel() * t.element_size(), factor, self.intra)

    def _run(self, issue) -> None:
        """Issue ``issue()`` (an async collective: returns its Work) in turn, then wait."""
        t0, c0 = time.perf_counter(), time.thread_time()
        rider = self.rider
        with self.ticket.turn() if self.ticket is not None else contextlib.nullcontext():
            if rider.tensor is not None and rider.work is None:
                rider.work = dist.all_reduce(rider.tensor, op=dist.ReduceOp.MAX,
                                             group=rider.group, async_op=True)
            work = issue()
        work.wait()
        self.traffic.comm_s += time.perf_counter() - t0
        self.traffic.comm_cpu_s += time.thread_time() - c0

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        W = self.world_size
        self._count(t, 2 * (W - 1) / W)
        if W > 1:
            self._run(lambda: dist.all_reduce(t, op=_OPS[op], group=self.group, async_op=True))
        return t

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """t: (W * s,) -> (s,): the sum over ranks of this rank's s-element part."""
        W = self.world_size
        self._count(t, (W - 1) / W)
        if W == 1:
            return t.clone()
        out = t.new_empty(t.numel() // W)
        src = t.contiguous()
        self._run(lambda: dist.reduce_scatter_tensor(out, src, group=self.group, async_op=True))
        return out

    def flag(self, bad: torch.Tensor) -> None:
        """Send ``bad`` (a small float tensor, e.g. 1.0 where this rank's bucket is not finite)
        with this exchange's first collective (MAX over ranks, in place): no turn, no round
        trip and no host sync of its own. Read it with :meth:`flag_result` after the
        exchange's last collective."""
        W = dist.get_world_size(self.rider.group) if self.rider.group is not None else 1
        self.traffic.add(bad.numel() * bad.element_size(), 2 * (W - 1) / W)
        if W > 1:
            self.rider.tensor, self.rider.work = bad, None

    def flag_result(self, bad: torch.Tensor) -> list[float]:
        """The flag's values, MAX over ranks: the one host read of the flag, once per exchange
        after its last collective (its own turn only if the exchange issued none)."""
        self.flag_done(bad)
        return bad.tolist()

    def flag_done(self, bad: torch.Tensor) -> torch.Tensor:
        """``bad`` once its MAX over ranks has landed (on a GPU the stream waits, not the
        host), read by no one here: after the exchange's last collective."""
        rider = self.rider
        if rider.tensor is not None:
            if rider.work is None:  # issued with a collective of its own
                self._run(lambda: _DONE)
            t0, c0 = time.perf_counter(), time.thread_time()
            rider.work.wait()
            self.traffic.comm_s += time.perf_counter() - t0
            self.traffic.comm_cpu_s += time.thread_time() - c0
            rider.tensor = rider.work = None
        return bad

    def allgather(self, t: torch.Tensor) -> torch.Tensor:
        """(W, *t.shape): every rank's t, in rank order."""
        W = self.world_size
        self._count(t, W - 1)
        out = torch.empty((W, *t.shape), dtype=t.dtype, device=t.device)
        if W > 1:
            src = t.contiguous()
            self._run(lambda: dist.all_gather(list(out.unbind(0)), src, group=self.group,
                                              async_op=True))
        else:
            out[0].copy_(t)
        return out

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """t: (W, ...); row j goes to rank j. Returns (W, ...): row i came from rank i."""
        W = self.world_size
        if t.shape[0] != W:
            raise ValueError(f"all_to_all needs {W} rows, got {t.shape[0]}")
        self._count(t, (W - 1) / W)
        if W == 1:
            return t.clone()
        out = torch.empty_like(t)
        src = t.contiguous()
        self._run(lambda: dist.all_to_all_single(out, src, group=self.group, async_op=True))
        return out


# The control plane: collectives outside any bucket's exchange (registration's agreement,
# the warm-up's window statistics, the topology probe, a checkpoint gathered onto rank 0,
# a step check with no rows to exchange). Each is issued at once, so the caller makes sure
# no exchange is in flight on its group (``HookState.drain()``) or that it runs where
# the job runs no exchange at all (registration, a checkpoint between steps).

def all_reduce_now(t: torch.Tensor, op: str = "sum", group=None,
                   traffic: Traffic | None = None) -> torch.Tensor:
    """In place over ``group``: ``op`` ("sum" or "max") of every rank's t; its bytes counted
    into ``traffic`` when given."""
    W = dist.get_world_size(group)
    if traffic is not None:
        traffic.add(t.numel() * t.element_size(), 2 * (W - 1) / W)
    if W > 1:
        dist.all_reduce(t, op=_OPS[op], group=group)
    return t


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj`` over ``group``, in group rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj) -> list | None:
    """Every rank's ``obj`` on rank 0 of the default group (None elsewhere)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def barrier(group=None) -> None:
    dist.barrier(group=group)
