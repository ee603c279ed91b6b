"""The hook state: one method's config and compressor, its per-parameter memory and step
counter, and the lanes that run the exchanges. What it owns, one module each:

  engine.py      lanes (threads, process groups, CUDA streams) and the one global order in
                 which collectives are issued
  guard.py       the inf/NaN guard
  delayed.py     delayed averaging: exchanges owed, ``flush``
  telemetry.py   ``stats()`` and TensorBoard scalars
  checkpoint.py  ``state_dict`` / ``load_state_dict``
  local.py       ``local_steps``: inner steps without exchange, the outer step every H
  warmup.py      the adaptive warm-up: dense until the gradient norm settles

This module ties them together: ``submit`` (DDP's thread: step counter, a ticket in the
order, the lane) and ``_reduce`` (a lane: the method's exchange of one bucket). The hook
itself returns a future at once: backward never waits on the network.
"""
from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
import zlib
from typing import Sequence

import torch
import torch.distributed as dist

from ..comm import Comm, Traffic
from ..compressors import METHODS
from ..compressors.base import ParamSlice
from ..config import MethodConfig
from ..memory import ParamMemory
from .checkpoint import Checkpoint
from .delayed import Delayed, _Pending, _slices
from .engine import Exchange, Lane, Sequencer, Ticket
from .guard import Guard
from . import optimizer as optimizer_binding
from .local import Local, _node_average
from .telemetry import Telemetry, _sq_norm
from .topology import Shards, base_name
from .warmup import Warmup

# A collective waiting longer than this for its turn raises instead of hanging (its turn
# waits for buckets DDP has not submitted yet, or for earlier exchanges to issue theirs).
TURN_TIMEOUT_S = 600.0

_MIX = 0x9E3779B97F4A7C15
_LIVE: "weakref.WeakSet[GradcompState]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for state in list(_LIVE):
        state.close()


def _mix(*parts: int) -> int:
    h = 0
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFFFFFF)) * _MIX + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    return h >> 1


class _Ctx:
    """BucketContext for one bucket at one step (see compressors.base.BucketContext)."""

    def __init__(self, state: "GradcompState", comm: Comm, bucket: int, params: list[ParamSlice],
                 param_tensors, device, step: int, live=None):
        self.state, self.bucket, self.params = state, bucket, params
        self.comm, self.step, self.device, self.live = comm, step, device, live
        self.grad_dtype = torch.float32  # the gradient's own dtype (set by _reduce)
        self.logging = state._writer is not None
        self.details = self.logging and state._details
        self._tensors = param_tensors

    def memory(self, slot):
        return self.state.memory.flat(slot, self.bucket, [p.name for p in self.params],
                                      [p.numel for p in self.params], self.device)

    def scalars(self, slot):
        return self.state.memory.flat(slot, self.bucket, [p.name for p in self.params],
                                      [1] * len(self.params), self.device)

    def tensor(self, slot, name, init):
        return self.state.memory.tensor(slot, name, init)

    def segment_ids(self):
        return torch.repeat_interleave(
            torch.arange(len(self.params), device=self.device),
            torch.tensor([p.numel for p in self.params], device=self.device))

    def param_values(self):
        if self._tensors is None:
            raise RuntimeError("this bucket was reduced without its parameters")
        return torch.cat([t.detach().reshape(-1).float() for t in self._tensors])

    def seed(self, stream, name):
        return _mix(self.state.config.seed, self.step, zlib.crc32(name.encode()), self.comm.rank,
                    stream)

    def log(self, key, value):
        if not self.logging:
            return
        with self.state._lock:
            logs = self.state._logs.setdefault(self.step, {})
            total, n = logs.get(key, (0.0, 0))
            logs[key] = (total + value, n + 1)


class GradcompState(Guard, Local, Delayed, Telemetry, Checkpoint, Warmup):
    """Everything one registered hook owns. Build it with :func:`gradcomp.register`, or
    directly to call ``register_comm_hook(state, gradcomp.hook)`` yourself."""

    def __init__(self, method: str, config: MethodConfig | None = None, *, group=None,
                 lane_groups: Sequence = (), param_names: dict[int, str] | None = None,
                 param_numels: dict[str, int] | None = None, model=None):
        """``model``: the module (DDP-wrapped or not) whose parameters the state will see;
        their names key its memory. Needed where the hook is registered by hand
        (``ddp.register_comm_hook(gradcomp.State("onebit", model=net), gradcomp.hook)``),
        which then also creates the state's own process group (collective: on every rank).
        :func:`gradcomp.register` does both itself, and binds the optimizer (``dgc``, Adam)."""
        owned = []
        if model is not None:
            module = getattr(model, "module", model)
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"model= must be a torch.nn.Module, got {type(model).__name__}")
            trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            param_names = {id(p): n for n, p in trainable}
            param_numels = {n: p.numel() for n, p in trainable}
            if group is None and dist.is_initialized():
                # a group of its own (collective: every rank builds its state): DDP's own
                # collectives on the default group must not interleave with the exchanges
                group = dist.new_group(ranks=dist.get_process_group_ranks(
                    getattr(model, "process_group", None) or dist.group.WORLD))
                owned = [group]
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}: allowed {', '.join(sorted(METHODS))}")
        spec = METHODS[method]
        config = config if config is not None else spec.config()
        if not isinstance(config, spec.config):
            raise TypeError(f"method {method!r} takes a {spec.config.__name__}, "
                            f"got {type(config).__name__}")
        self.method, self.config = method, config
        self.compressor = spec.compressor(config)
        self.memory = ParamMemory()
        self.group = group
        self.stats_group = None  # the warm-up's statistics, where not ``group`` (HSDP: the mesh)
        self._detach: list = []  # undo an adapter's hooks at close() (hooks/fsdp.py)
        self._owned_groups = owned  # process groups created for this state: destroyed at close()
        self._lane_groups = list(lane_groups)  # more process groups: more buckets in flight
        self._param_names = param_names or {}
        self._param_numels = param_numels or {}
        self._step = -1                 # index of the step in flight
        self._records: dict[int, list] = {}  # step -> [Traffic, raw bytes], summed over buckets
        self._layouts: dict[int, tuple] = {}
        self.trace: list | None = None  # set to [] to record (event, bucket, start, end) times
        self._writer = None
        self._details = False
        self._logs: dict = {}  # step -> key -> (sum, count) of what methods logged
        self._written = -1     # the last step whose scalars went to the writer
        self._pending: list[_Pending] = []   # delayed exchanges, oldest first
        self._skipped: int | None = None     # index of a step whose gradients were not finite
        self.scaler = None  # a torch.amp.GradScaler whose scale the gradients carry
        self._reuse_skipped = True  # a skipped step's index is taken again (not under FSDP)
        self._params: dict[str, torch.Tensor] = {}
        self.local_size = 0  # ranks per node of a hierarchical topology (0: flat)
        self.topology_probe = None  # topology=auto's measurement (hooks/ddp.py), if it ran
        self._adam = None  # the Adam binding (hooks/optimizer.py), once bound
        self.sharded = ""  # "FSDP"/"HSDP" when the FSDP adapter serves this state
        self._local_init()
        self._warmup_init()
        self._setup_runtime()

    # ------------------------------------------------------------------ runtime
    def _setup_runtime(self):
        self._lanes = [Lane(self._worker, g) for g in [self.group, *self._lane_groups]]
        self._seq = Sequencer(len(self._lanes))
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._shard_cache: dict = {}

    def __getstate__(self):
        d = self.__dict__.copy()
        self.drain()
        for k in ("group", "stats_group", "_lane_groups", "_lanes", "_seq", "_lock", "_error", "_shard_cache",
                  "_param_names",
                  "_params", "_writer", "scaler", "_outer_buckets", "_outer_buffers",
                  "_local_hooks", "_adam", "_owned_groups", "_detach"):
            d.pop(k, None)
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self.__dict__.setdefault("_reuse_skipped", True)
        self.group, self._param_names, self._params, self._writer = None, {}, {}, None
        self.stats_group, self._detach = None, []
        self._lane_groups, self.scaler, self.local_size = [], None, 0
        self._adam, self._owned_groups = None, []
        self._local_setup()
        self._setup_runtime()

    @property
    def world_size(self) -> int:
        return self._lanes[0].comm.world_size

    def add_lanes(self, groups: Sequence) -> None:
        """More process groups, one lane each (before the first exchange)."""
        self._lane_groups += list(groups)
        self._lanes += [Lane(self._worker, g) for g in groups]
        self._seq = Sequencer(len(self._lanes))

    @property
    def lanes(self) -> int:
        """How many buckets' exchanges can run at once (one process group each)."""
        return len(self._lanes)

    @property
    def step(self) -> int:
        """Optimizer steps whose communication has started."""
        return self._step + 1

    # ------------------------------------------------------------------ the work
    def _begin(self, bucket: int) -> int:
        """Book-keeping on the caller's thread: the step counter. A step whose gradients held
        inf/NaN on some rank is not an optimizer step (a GradScaler skips it): without delay,
        the next step reuses its index, so schedules and random streams go on as if it
        never happened. Here, before any bucket of a step is queued, the adaptive warm-up
        decides whether the step is compressed (warmup.py)."""
        if bucket == 0:
            if (self._skipped is not None and self._skipped == self._step and not self.config.delay
                    and self._reuse_skipped):
                self._skipped = None
                with self._lock:
                    self._records.pop(self._step, None)
                    self._logs.pop(self._step, None)
                self._warmup_redo(self._step)
            else:
                self._step += 1
            self._warmup_begin(max(self._step, 0))
        return max(self._step, 0)

    def reduce(self, x: torch.Tensor, params: Sequence[ParamSlice], bucket: int = 0,
               param_tensors=None) -> torch.Tensor:
        """Synchronously reduce one flat bucket (any float dtype); returns the average in
        x's dtype. The DDP hook runs exactly this, on the communication thread."""
        step = self._begin(bucket)
        self._warmup_observe(step, x, params)
        live = self.compressor.live([base_name(p.name) for p in params])  # (HSDP: pieces)
        return self._reduce(self._lanes[0], Exchange(bucket, x, list(params), step,
                                                     params=param_tensors, live=live))

    def _reduce(self, lane, ex: Exchange):
        """One bucket's exchange on ``lane``. ``ex.plain``: a reduce(x, ctx) run instead of
        the method's, without memory or guard (local_steps: an inner step's node average, the
        buffers' average)."""
        buf, params, bucket, param_tensors = ex.buf, ex.slices, ex.bucket, ex.params
        step, scale, live, plain = ex.step, ex.scale, ex.live, ex.plain
        if bucket == 0 and self._writer is not None:
            # the last step every exchange of which has finished by now
            self._write_scalars(step - 1 - self.config.delay)
        traffic = Traffic()
        for c in lane.comms():
            c.traffic = traffic
        x = buf if buf.dtype == torch.float32 else buf.float()
        if scale is not None:  # memory holds unscaled values: the loss scale may change
            x = x / scale
        t0 = time.perf_counter()
        if lane.inter is not None:  # hierarchical: the method runs on this rank's shard
            shards = self._shards(params, lane.intra.rank, buf.device)
            ctx = _Ctx(self, lane.inter, bucket, shards.mine, shards.pieces(param_tensors),
                       buf.device, step, shards.live(live))
            L, real = lane.intra.world_size, shards.real

            def run(y, method):
                node = lane.intra.reduce_scatter(shards.gather(y)).div_(L)
                if real:  # the method sees this rank's pieces, not the shard's padding; ranks
                    # of one local index hold the same pieces, so they agree on skipping
                    node[:real] = method(node[:real], ctx)
                node[real:] = 0
                return shards.scatter(lane.intra.allgather(node).reshape(-1))
        else:
            ctx = _Ctx(self, lane.comm, bucket, params, param_tensors, buf.device, step, live)

            def run(y, method):
                return method(y, ctx)
        ctx.grad_dtype = buf.dtype
        if plain is not None:
            out = run(x, plain)
        elif self.compressor.stateless:
            out = run(x, self.compressor.reduce)
        else:
            dense = self._dense(step)
            # the residual diagnostic: compressed steps, flat topology (not measured per shard)
            slot = (self.compressor.residual_slot if ctx.details and self.config.error_feedback
                    and not dense and lane.inter is None else None)
            if slot:
                names = [p.name for p in params]
                owed = _sq_norm(x, params, self.memory.peek(slot, names))
            # warm-up: uncompressed (DGC's dense step still moves its velocity: guarded too),
            # in bf16 on the wire with dense_wire (Adam's warm-up by default)
            ctx.wire16 = dense and self.dense_wire16()
            method = self.compressor.dense if dense else self.compressor.reduce
            # Adam: compressed in the update's own scale, g / sqrt(v) (hooks/optimizer.py)
            pre = None if dense or self._adam is None else self._adam.scale(params, buf.device)
            mom = None if dense or self._adam is None else self._adam.momentum(params, buf.device)
            if mom is not None:  # Adam's next first moment, a g + b (hooks/optimizer.py)
                x = torch.addcmul(mom[1], x, mom[0])
            if pre is not None:
                x = x * pre
            out = self._guarded(x, ctx, lane.comm, lambda y: run(y, method))
            if pre is not None:
                out = out / pre
            if mom is not None:
                out = (out - mom[1]).div_(mom[0])
            if slot and self._skipped != step:
                kept = _sq_norm(None, params, self.memory.peek(slot, names))
                self._log_ratio(step, "residual_energy", kept, owed)
        if scale is not None:
            out = out * scale
        if out is not buf:
            buf.copy_(out)
        traffic.total_s += time.perf_counter() - t0
        with self._lock:
            rec = self._records.setdefault(step, [Traffic(), 0])
            rec[0].merge(traffic)
            rec[1] += buf.numel() * buf.element_size()
            for old in [k for k in self._records if k < step - self.config.delay - 4]:
                del self._records[old]
        return buf

    def _shards(self, params, local: int, device) -> Shards:
        key = (tuple(p.name for p in params), str(device))
        with self._lock:
            hit = self._shard_cache.get(key)
            if hit is None:
                hit = self._shard_cache[key] = Shards(params, self.local_size, local, device)
            return hit

    def set_topology(self, local_size: int, groups) -> None:
        """Hierarchical: ``local_size`` ranks per node; ``groups``: per lane, (the node's
        group, the group of this local index across nodes). Before the first exchange."""
        self.local_size = local_size
        for lane, (intra, inter) in zip(self._lanes, groups):
            lane.set_hierarchy(intra, inter)

    # ------------------------------------------------------------------ DDP side
    def submit(self, bucket: int, buf: torch.Tensor, params, last: bool = True
               ) -> torch.futures.Future:
        """Queue one bucket's exchange; the returned future completes with the average.
        ``last``: DDP's last bucket of this backward pass (it closes the round of the
        collective order)."""
        names = []
        for p in params:
            name = self._param_names.get(id(p))
            if name is None:
                raise RuntimeError(
                    "a bucket holds a parameter the state does not know: build the state with "
                    "the model it serves, gradcomp.State(method, config, model=net), or use "
                    "gradcomp.register(ddp_model, method, optimizer=opt)")
            names.append(name)
        slices = _slices(zip(names, params))
        devices = [buf.device] if buf.is_cuda else None
        if self.local:  # an inner step: this rank's gradient, or under a hierarchy the node's
            if not self._local_hooks:
                raise RuntimeError(f"local_steps={self.config.local_steps}: no optimizer to run "
                                   f"the outer step from; build the state with gradcomp.register"
                                   f"(model, ..., optimizer=opt) or call state.bind_local(model."
                                   f"module, opt, model.bucket_bytes_cap) before training")
            fut = torch.futures.Future(devices=devices)
            if not self.local_size:
                fut.set_result(buf)
                return fut
            lane = self._lanes[bucket % len(self._lanes)]
            self._enqueue(lane, Exchange(bucket, buf, slices, self.step, plain=_node_average,
                                         fut=fut), last)
            return fut
        step = self._begin(bucket)
        scale = self._scale()
        self._warmup_observe(step, buf, slices, scale)
        if self._adam is not None and not self._dense(step):
            self._adam.scale(slices, buf.device)  # built here, while the optimizer is idle
        live = self.compressor.live(names)
        lane = self._lanes[bucket % len(self._lanes)]
        D = self.config.delay
        layout = tuple(names)
        if D and self._layouts.get(bucket) != layout and len(self._lanes) > 1:
            # DDP moved parameters between buckets (its rebuild): a parameter's previous
            # exchange may sit on another lane and must finish before its next one starts
            # (without delay every exchange of the previous step has finished already). Only
            # earlier steps': this step's may wait for this very bucket's turn.
            self.drain(before=step)
        self._layouts[bucket] = layout
        if self.trace is not None:
            now = time.perf_counter()
            self.trace.append(("submit", bucket, now, now))
        if D == 0:
            fut = torch.futures.Future(devices=devices)
            self._enqueue(lane, Exchange(bucket, buf, slices, step, params=list(params),
                                         scale=scale, live=live, fut=fut), last)
            return fut
        # Delayed averaging: exchange a copy in the background, apply the local gradient now
        # plus the correction (average - local) of step - D. The copy, and the parameters
        # where the method reads them (DGC's weight decay), are taken now: the optimizer
        # updates the parameters while the exchange runs.
        for name, p in zip(names, params):
            self._params[name] = p
        tensors = list(params)
        if self.compressor.reads_params(live):
            tensors = [p.detach().clone() for p in params]
        job = torch.futures.Future(devices=devices)  # its wait orders after the lane's stream
        self._enqueue(lane, Exchange(bucket, buf.clone(), slices, step, params=tensors, live=live,
                                     fut=job, delayed=True), last)
        self._pending.append(_Pending(step, slices, job))
        corr = self._take(step - D, slices, buf)
        if corr is not None:
            buf.add_(corr)
        fut = torch.futures.Future(devices=devices)
        fut.set_result(buf)
        return fut

    def _enqueue(self, lane, ex: Exchange, last: bool) -> None:
        """Open the exchange's place in the order and queue it, after everything it reads was
        enqueued on this stream (the ready event is recorded last). ``last``: DDP's last
        bucket of this backward pass (it closes the round)."""
        if ex.buf.is_cuda:
            ex.event = torch.cuda.Event()
            ex.event.record()
        ex.rnd = self._seq.open(ex.bucket, last)
        self._put(lane, ex)

    def _scale(self):
        """The loss scale the current gradients carry (a copy: the scaler updates it in place
        after the step), or None without an enabled GradScaler."""
        s = self.scaler
        if s is None or not s.is_enabled() or getattr(s, "_scale", None) is None:
            return None
        return s._scale.detach().clone()

    def bind_adam(self, optimizer) -> None:
        """With Adam/AdamW and ``adam`` "auto"/"freeze": freeze Adam's second moment for the
        compressed parameters once compression starts (hooks/optimizer.py)."""
        if (self.compressor.stateless or self.config.adam == "off" or self.local
                or not optimizer_binding.is_adam(optimizer)):
            return
        names = self._param_names
        mode = self.adam_mode()
        self._adam = optimizer_binding.FrozenVariance(
            optimizer, lambda p: id(p) in names and self.compressor.compresses(names[id(p)],
                                                                               tuple(p.shape)),
            lambda: not self._dense(max(self._step, 0)), names,
            precondition=mode == "precondition", momentum=mode == "momentum")

    def dense_wire16(self) -> bool:
        """Whether the warm-up's dense steps go as bf16 (``dense_wire``; "auto": with
        Adam/AdamW bound)."""
        w = self.config.dense_wire
        return w == "bfloat16" or (w == "auto" and self._adam is not None)

    def adam_mode(self) -> str:
        """What ``adam`` runs with Adam/AdamW. "auto": the method's measured choice
        (``Compressor.adam_exchange``: "momentum", the first moment exchanged, for onebit,
        topk, threshold, dgc; "freeze" for powersgd, terngrad) under DDP without ``delay``
        and with error feedback on, else "freeze" (FSDP/HSDP: a rank holds only its shard
        of the moment; ``delay``: the moment read at the exchange is not the one the late
        average is applied to)."""
        c = self.config
        if c.adam != "auto":
            return c.adam
        ok = c.error_feedback and not c.delay and not self.sharded
        return self.compressor.adam_exchange if ok else "freeze"

    def close(self) -> None:
        """Stop the communication threads (after the exchanges queued so far). Called at
        interpreter exit for every state, so no thread still holds a process group while
        it is destroyed. An attached writer gets the scalars of the steps finished since
        the last write (they otherwise go out with the next step's first exchange) and is
        flushed."""
        for lane in self._lanes:
            lane.close()
        destroy_groups(self._owned_groups)
        self.compressor.unbind()
        if self._adam is not None:
            self._adam.close()
            self._adam = None
        self._local_close()
        for undo in self._detach:  # an adapter's own hooks (hooks/fsdp.py)
            undo()
        self._detach = []
        self.group = self.stats_group = None
        if self._writer is not None:
            for step in range(self._written + 1, self._step + 1):
                self._write_scalars(step)
            if hasattr(self._writer, "flush"):
                self._writer.flush()

    def _put(self, lane: Lane, job) -> None:
        if lane.put(job):
            _LIVE.add(self)

    def _worker(self, lane: Lane):
        while True:
            ex = lane.queue.get()
            if ex is None:
                return
            buf, fut, delayed = ex.buf, ex.fut, ex.delayed
            ticket = Ticket(self._seq, ex.rnd, ex.bucket, TURN_TIMEOUT_S)
            if self._error is not None:
                ticket.close()
                fut.set_exception(RuntimeError(f"gradcomp: an earlier exchange failed: {self._error}"))
                continue
            stream = lane.stream(buf.device)
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    if stream is not None:  # the codec runs after backward made the bucket
                        stream.wait_event(ex.event)
                        buf.record_stream(stream)
                    local = buf.clone() if delayed else None
                    t0 = time.perf_counter()
                    lane.set_ticket(ticket)
                    with torch.profiler.record_function(
                            f"gradcomp.{self.method}.bucket{ex.bucket}"):
                        out = self._reduce(lane, ex)
                    ticket.close()  # as soon as it issues no more (again in finally: a no-op)
                    if self.trace is not None:
                        self.trace.append(("exchange", ex.bucket, t0, time.perf_counter()))
                    # on CUDA the future records the lane stream's work: DDP's wait orders after it
                    fut.set_result(out.sub_(local) if delayed else out)
            except BaseException as exc:  # noqa: BLE001  (handed to DDP, which re-raises)
                self._error = exc
                fut.set_exception(exc)
            finally:
                ticket.close()
                lane.set_ticket(None)


def destroy_groups(groups) -> None:
    """Destroy the process groups register created (a refusal, or the state's close())."""
    for g in groups:
        if isinstance(g, dist.ProcessGroup) and dist.is_initialized():
            try:
                dist.destroy_process_group(g)
            except (RuntimeError, ValueError, KeyError):
                pass  # already gone with the default group
    groups.clear()
