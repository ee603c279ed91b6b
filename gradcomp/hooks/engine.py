"""The engine: lanes that run buckets' exchanges side by side, and the one global order in
which every collective is issued.

Lanes. A bucket's exchange may need several dependent collectives (PowerSGD's P then Q,
1-bit's all-to-all then allgather). Each exchange runs start to finish on a *lane*: a thread
with a process group of its own (and, on CUDA, a stream of its own). Bucket b goes to lane
b % lanes, so a bucket's consecutive steps run in order (its memory carries from one to the
next) and different buckets' exchanges run side by side.

Order. Lanes alone would issue collectives in an order that depends on thread timing: on
each process group it is the same on every rank, across groups it is not. NCCL does not
allow that (operations on several communicators of one device must be launched in one
order on every rank, or they can deadlock). So every collective takes a ticket from the
:class:`Sequencer` and is issued only when its turn comes; the turn order is the same on
every rank:

    key = (round, bucket // lanes, phase, bucket % lanes)

``round`` counts DDP's backward passes (a new one starts after the bucket DDP marks last),
``phase`` counts the collectives of one exchange. Buckets are taken in groups of ``lanes``:
inside a group every bucket's first collective goes before any bucket's second, so the
group's round trips overlap on a link with latency (what lanes are for); a group's
collectives all go before the next group's. A collective is issued asynchronously while its
turn is held, then waited for after the turn is given up, so the next ticket never waits
for this one's round trip. Exchanges of a round all go before the next round's (with
``delay`` the background exchange of step t is issued before step t+1's).

Only where it is needed. The order costs overlap: inside a group of buckets a bucket's
second collective waits until every bucket of the group has issued its first, so a two-phase
exchange (1-bit, TernGrad, PowerSGD) of the first bucket waits for the group's last bucket,
which backward hands over at its very end (ResNet-18 under DDP's defaults: 3 buckets, one
group; the first bucket's exchange finished after backward's last gradient, measured on
the 100 Mbit/s rig, ResNet-18 on 2 gloo ranks). gloo needs no order across process groups: each group has its
own connections and threads, and each lane's group is used by that lane's thread alone, whose
collectives follow its exchanges in submission order, the same on every rank. So where every
lane's process groups are gloo, turns are granted at once (``Sequencer.ordered`` False); any
other backend (NCCL) takes them in key order.
"""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm import Comm, Rider


@dataclass
class Exchange:
    """One bucket's exchange: what a lane reduces and how. Built by the state's ``submit``
    (DDP's hook), ``reduce`` (the synchronous path: FSDP, the topology probe) and local
    steps' outer round; ``Engine.enqueue`` fills in ``event`` and ``rnd``."""

    bucket: int
    buf: torch.Tensor              # the flat bucket (a copy of it under ``delay``)
    slices: list                   # a ParamSlice per parameter: name, offset, numel
    step: int                      # the method's step counter for this exchange
    params: list | None = None     # the parameters' tensors (DGC's weight decay reads them)
    scale: torch.Tensor | None = None  # the GradScaler's loss scale the gradients carry
    live: Any = None               # the compressor's view of which parameters are live
    plain: Callable | None = None  # a reduce(x, ctx) run instead of the method's (no memory)
    fut: torch.futures.Future | None = None  # completed with the result
    delayed: bool = False          # hand back average - local (delayed averaging)
    event: Any = None              # CUDA: the bucket's ready event, recorded at enqueue
    rnd: Any = None                # its round in the collective order

class Sequencer:
    """Turns for collectives, in key order, identical on every rank (see module doc).

    An exchange is ``open``ed on DDP's thread when its bucket is submitted (in bucket order,
    as DDP submits them), takes a :meth:`turn` for each collective it issues (phases 0, 1,
    ...), and is ``close``d when it will issue no more. A turn is granted when no open
    exchange, and no bucket of the round not yet submitted, could still issue a smaller key.
    """

    def __init__(self, lanes: int, ordered: bool | None = None):
        self.lanes = lanes
        # False: turns granted at once (gloo: see the module doc); None: not decided yet
        # (the state decides at its first exchange, from its lanes' backends)
        self.ordered = ordered
        self._cv = threading.Condition()
        self._next: dict[tuple[int, int], int] = {}  # open (round, bucket) -> next phase
        self._round = 0
        self._submitted = -1     # highest bucket submitted in the current round
        self._last_seen = False  # the current round's last bucket was submitted

    def key(self, rnd: int, bucket: int, phase) -> tuple:
        return (rnd, bucket // self.lanes, phase, bucket % self.lanes)

    def open(self, bucket: int, last: bool) -> int:
        """Register bucket ``bucket``'s exchange; returns its round."""
        with self._cv:
            if self._last_seen:
                self._round, self._submitted, self._last_seen = self._round + 1, -1, False
            self._next[(self._round, bucket)] = 0
            self._submitted = max(self._submitted, bucket)
            self._last_seen = last
            self._cv.notify_all()
            return self._round

    def close(self, rnd: int, bucket: int) -> None:
        with self._cv:
            self._next.pop((rnd, bucket), None)
            self._cv.notify_all()

    def _clear(self, rnd: int, bucket: int, phase: int) -> bool:
        mine = self.key(rnd, bucket, phase)
        for (r, b), p in self._next.items():
            if (r, b) != (rnd, bucket) and self.key(r, b, p) < mine:
                return False
        if rnd == self._round and not self._last_seen:
            # buckets DDP has not handed over yet would issue their first collective here
            if self.key(rnd, self._submitted + 1, 0) < mine:
                return False
        return True

    @contextmanager
    def turn(self, rnd: int, bucket: int, phase: int, timeout: float | None = None):
        """Hold the turn of (rnd, bucket, phase) while issuing; then the next key may go."""
        with self._cv:
            if self.ordered is not False and not self._cv.wait_for(
                    lambda: self._clear(rnd, bucket, phase), timeout):
                raise RuntimeError(f"gradcomp: collective of bucket {bucket}, phase {phase} "
                                   f"waited {timeout} s for its turn (a bucket never submitted?)")
        try:
            yield
        finally:
            with self._cv:
                if (rnd, bucket) in self._next:
                    self._next[(rnd, bucket)] = phase + 1
                self._cv.notify_all()


class Ticket:
    """One exchange's place in the order: every collective its lane's comms issue takes the
    next phase's turn (the inf/NaN flag rides in the first one's: comm.Rider)."""

    def __init__(self, seq: Sequencer, rnd: int, bucket: int, timeout: float | None):
        self.seq, self.rnd, self.bucket, self.timeout = seq, rnd, bucket, timeout
        self.phase = 0

    @contextmanager
    def turn(self):
        with self.seq.turn(self.rnd, self.bucket, self.phase, self.timeout):
            self.phase += 1
            yield

    def close(self) -> None:
        self.seq.close(self.rnd, self.bucket)


class Lane:
    """A communication thread, the process group it alone uses and (on CUDA) its stream;
    its jobs run in order."""

    def __init__(self, worker, group, flag_group=None):
        """``flag_group``: where the inf/NaN flag goes round, if not ``group`` (HSDP)."""
        self.worker = worker
        self.comm = Comm(group, rider=None if flag_group is None else Rider(flag_group))
        self.intra: Comm | None = None  # hierarchical: the node's group ...
        self.inter: Comm | None = None  # ... and this local index's group across nodes
        self.queue: queue.Queue | None = None
        self.thread: threading.Thread | None = None
        self._stream = None

    def set_hierarchy(self, intra, inter) -> None:
        """Process groups of a hierarchical topology; they share the flat comm's inf/NaN rider."""
        self.intra = Comm(intra, rider=self.comm.rider, intra=True)
        self.inter = Comm(inter, rider=self.comm.rider)

    def comms(self) -> list[Comm]:
        return [c for c in (self.comm, self.intra, self.inter) if c is not None]

    def gloo(self) -> bool:
        """Whether every process group this lane issues on is gloo's alone (no NCCL)."""
        return all(c.group is None or dist.get_backend(c.group) == "gloo" for c in self.comms())

    def set_ticket(self, ticket) -> None:
        for c in self.comms():
            c.ticket = ticket

    def stream(self, device: torch.device):
        """The lane's own CUDA stream on ``device`` (None on the CPU): its codec runs there,
        not serialized behind backward on the default stream."""
        if device.type != "cuda":
            return None
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def put(self, job) -> bool:
        """Queue a job; True when this started the lane's thread."""
        started = False
        if self.thread is None:
            self.queue = queue.Queue()
            self.thread = threading.Thread(target=self.worker, args=(self,),
                                           name="gradcomp-comm", daemon=True)
            self.thread.start()
            started = True
        self.queue.put(job)
        return started

    def close(self) -> None:
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join(timeout=30)
            self.thread = None
        for c in self.comms():
            c.group = None


# A collective waiting longer than this for its turn raises instead of hanging (its turn
# waits for buckets DDP has not submitted yet, or for earlier exchanges to issue theirs).
TURN_TIMEOUT_S = 600.0


class Engine:
    """A state's lanes (one per process group), the order their collectives take, and the
    first error an exchange raised (every later exchange fails with it). ``reduce(lane, ex)``
    runs one exchange on a lane's thread; ``on_start()`` is called when a lane's thread
    starts (the state registers itself to be closed at exit)."""

    def __init__(self, reduce, label: str, groups, flag_group=None, on_start=None):
        """``groups``: a process group per lane; ``flag_group``: where the first lane's inf/NaN
        flag goes round, if not its group (HSDP: the whole mesh)."""
        self.reduce, self.label, self.on_start = reduce, label, on_start
        self.lanes = [Lane(self._worker, g, flag_group if i == 0 else None)
                      for i, g in enumerate(groups)]
        self.seq = Sequencer(len(self.lanes))
        self.error: BaseException | None = None
        self.trace: list | None = None  # [] records (event, bucket, start, end) times

    def lane(self, bucket: int) -> Lane:
        return self.lanes[bucket % len(self.lanes)]

    def set_topology(self, groups) -> None:
        """Per lane, (the node's group, the group of this local index across nodes)."""
        for lane, (intra, inter) in zip(self.lanes, groups):
            lane.set_hierarchy(intra, inter)

    def enqueue(self, lane: Lane, ex: Exchange, last: bool) -> None:
        """Open the exchange's place in the order and queue it, after everything it reads was
        enqueued on this stream (the ready event is recorded last). ``last``: DDP's last
        bucket of this backward pass (it closes the round)."""
        if ex.buf.is_cuda:
            ex.event = torch.cuda.Event()
            ex.event.record()
        ex.rnd = self.seq.open(ex.bucket, last)
        if lane.put(ex) and self.on_start is not None:
            self.on_start()

    def failed(self, buf, exc: BaseException) -> torch.futures.Future:
        """A bucket's future that fails with ``exc``; every later exchange fails with it too."""
        self.error = exc
        fut = future(buf)
        fut.set_exception(exc)
        return fut

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()

    def _worker(self, lane: Lane):
        while True:
            ex = lane.queue.get()
            if ex is None:
                return
            if self.seq.ordered is None:  # decided once, before any collective is issued
                self.seq.ordered = not all(ln.gloo() for ln in self.lanes)
            ticket = Ticket(self.seq, ex.rnd, ex.bucket, TURN_TIMEOUT_S)
            if self.error is not None:
                ticket.close()
                ex.fut.set_exception(
                    RuntimeError(f"gradcomp: an earlier exchange failed: {self.error}"))
                continue
            try:
                self._run(lane, ex, ticket)
            except BaseException as exc:  # noqa: BLE001  (handed to DDP, which re-raises)
                self.error = exc
                ex.fut.set_exception(exc)
            finally:
                ticket.close()
                lane.set_ticket(None)

    def _run(self, lane: Lane, ex: Exchange, ticket: Ticket) -> None:
        buf = ex.buf
        stream = lane.stream(buf.device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None:  # the codec runs after backward made the bucket
                stream.wait_event(ex.event)
                buf.record_stream(stream)
            local = buf.clone() if ex.delayed else None
            t0 = time.perf_counter()
            lane.set_ticket(ticket)
            with torch.profiler.record_function(f"gradcomp.{self.label}.bucket{ex.bucket}"):
                out = self.reduce(lane, ex)
            ticket.close()  # as soon as it issues no more (again in finally: a no-op)
            if self.trace is not None:
                self.trace.append(("exchange", ex.bucket, t0, time.perf_counter()))
            # on CUDA the future records the lane stream's work: DDP's wait orders after it
            ex.fut.set_result(out.sub_(local) if ex.delayed else out)


def future(buf: torch.Tensor) -> torch.futures.Future:
    """A future for a bucket's result (on CUDA it records the buffer's device)."""
    return torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
