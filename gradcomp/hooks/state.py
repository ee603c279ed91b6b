"""The hook state: one method's config and compressor, its step counter, and the components
it owns, one module and one attribute each (each has its own interface; none reads
another's private attributes, tests/test_design.py checks):

  memory       ../memory.py     per-parameter memory (residuals, velocities, factors)
  guard        guard.py         the inf/NaN guard; ``guard.skipped``
  warmup       warmup.py        the adaptive warm-up: dense until the gradient norm settles
  delay        delayed.py       delayed averaging: exchanges owed, ``flush``
  rounds       local_steps.py   ``local_steps``: inner steps without exchange, the outer step
  telemetry    telemetry.py     byte/time counters and TensorBoard scalars
  hierarchy    topology.py      a hierarchical topology's ranks per node and shards
  adam         optimizer.py     the Adam binding (frozen variance, the momentum exchange)
  lanes        engine.py        threads, process groups, CUDA streams, and the one global
                                order in which every collective is issued (Sequencer)

``checkpoint.py`` assembles the checkpoint from the components' own ``state_dict()``.
This module ties them together: ``submit`` (DDP's thread: step counter, a ticket in the
order, the lane) and ``_reduce`` (a lane: the method's exchange of one bucket). The hook
itself returns a future at once: backward never waits on the network.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import time
import weakref
from typing import Sequence

import torch
import torch.distributed as dist

from .. import comm as collectives
from ..comm import Comm, Traffic
from ..compressors import METHODS
from ..compressors.base import ParamSlice
from ..config import MethodConfig
from ..memory import ParamMemory
from . import checkpoint
from . import optimizer as optimizer_binding
from .delayed import Delayed, flat_slices
from .engine import Exchange, Lane, Sequencer, Ticket
from .guard import Guard
from .local_steps import LocalSteps, node_average
from . import stages
from .plan import Plan, Sharding
from .telemetry import Telemetry
from .topology import Hierarchy, base_name
from .warmup import Warmup

# A collective waiting longer than this for its turn raises instead of hanging (its turn
# waits for buckets DDP has not submitted yet, or for earlier exchanges to issue theirs).
TURN_TIMEOUT_S = 600.0

_LIVE: "weakref.WeakSet[GradcompState]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for state in list(_LIVE):
        state.close()


def _planned(field: str, doc: str) -> property:
    """A read-only attribute of the state that is a field of its plan (hooks/plan.py)."""
    return property(lambda self: getattr(self.plan, field), doc=doc)


class GradcompState:
    """Everything one registered hook owns. Build it with :func:`gradcomp.register`, or
    directly to call ``register_comm_hook(state, gradcomp.hook)`` yourself."""

    def __init__(self, method: str, config: MethodConfig | None = None, *, group=None,
                 lane_groups: Sequence = (), param_names: dict[int, str] | None = None,
                 param_numels: dict[str, int] | None = None, model=None,
                 plan: Plan | None = None):
        """``plan``: what a registration decided (hooks/plan.py; its ``lane_groups`` and
        ``owned_groups`` join these). ``model``: the module (DDP-wrapped or not) whose parameters the state will see;
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
        self.param_names = param_names or {}    # id(parameter) -> name: the memory's keys
        self.param_numels = param_numels or {}  # name -> elements (checkpoints check them)
        self.group = group
        plan = plan if plan is not None else Plan()
        # the plan's process groups and the scaler are runtime (dropped when pickled)
        self.plan = dataclasses.replace(plan, owned_groups=(*plan.owned_groups, *owned))
        self._detach: list = []  # undo an adapter's hooks at close() (on_close)
        # more process groups: more buckets in flight
        self._lane_groups = [*plan.lane_groups, *lane_groups]
        self._step = -1                 # index of the step in flight
        self._layouts: dict[int, tuple] = {}
        self.trace: list | None = None  # set to [] to record (event, bucket, start, end) times
        # the components
        self.memory = ParamMemory()
        self.guard = Guard(self.memory)
        self.warmup = Warmup(config, self.compressor.stateless)
        self.delay = Delayed()
        self.rounds = LocalSteps(config)
        self.telemetry = Telemetry()
        self.hierarchy = Hierarchy()
        self.adam = None  # the Adam binding (hooks/optimizer.py), once bound
        self._setup_runtime()
        if plan.topology is not None:
            self.set_topology(*plan.topology)

    # ------------------------------------------------------------------ the plan's parts
    scaler = _planned("scaler", "A torch.amp.GradScaler whose loss scale the gradients carry.")
    stats_group = _planned("stats_group", "The warm-up's statistics' group where not ``group`` "
                                          "(HSDP).")
    owned_groups = _planned("owned_groups", "Process groups created for this state: destroyed "
                                            "at close().")
    load_group = _planned("load_group", "The loads' agreement, where an adapter made one "
                                        "(agree.py).")
    sharded = _planned("sharding", "The Sharding the state serves (false for DDP).")
    reuse_skipped = _planned("reuse_skipped", "Whether a skipped step's index is taken again.")
    topology_probe = _planned("topology_probe", "topology=auto's measurement (hooks/ddp.py), "
                                                "if it ran.")
    method_probe = _planned("method_probe", "method=auto's measurement (hooks/auto.py), if it "
                                            "ran.")

    # ------------------------------------------------------------------ runtime
    def _setup_runtime(self):
        # under HSDP the first lane's inf/NaN flag goes round the whole mesh (a shard's
        # replicas alone would leave the other shards waiting)
        flags = self.plan.stats_group if self.plan.sharding == Sharding.HSDP else None
        self._lanes = [Lane(self._worker, g, flags if i == 0 else None)
                       for i, g in enumerate([self.group, *self._lane_groups])]
        self._seq = Sequencer(len(self._lanes))
        self._error: BaseException | None = None

    def __getstate__(self):
        """Pickled without its runtime (process groups, threads, the model's tensors, the
        optimizer's hooks): the exchanges in flight are waited for first."""
        self.drain()
        d = self.__dict__.copy()
        for k in ("group", "_lane_groups", "_lanes", "_seq", "_error", "param_names", "adam",
                  "_detach"):
            d.pop(k, None)
        d["plan"] = self.plan.portable()
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self.group, self.param_names = None, {}
        self._lane_groups, self._detach, self.adam = [], [], None
        self._setup_runtime()  # (the hierarchy unpickles flat: hooks/topology.py)

    @property
    def world_size(self) -> int:
        return self._lanes[0].comm.world_size

    @property
    def rank(self) -> int:
        """This rank's index in the state's group."""
        return self._lanes[0].comm.rank

    @property
    def flat_comm(self) -> Comm:
        """The first lane's collectives over every rank of the group (the guard's flag)."""
        return self._lanes[0].comm

    @property
    def local_size(self) -> int:
        """Ranks per node of a hierarchical topology (0: flat)."""
        return self.hierarchy.local_size

    def on_close(self, undo) -> None:
        """Call ``undo()`` at close() (an adapter's hooks on the model or FSDP's groups)."""
        self._detach.append(undo)

    def resume_at(self, step: int) -> None:
        """The next step is ``step`` (a checkpoint's: ``state.step`` when it was written)."""
        self._step = step - 1
        self.telemetry.mark_written(self._step)

    @property
    def ordered(self) -> bool | None:
        """Whether collectives take turns in one global order, the same on every rank (what
        NCCL needs; hooks/engine.py): decided at the first exchange, False where every lane's
        process groups are gloo (which needs no order across groups), True otherwise; None
        until then. Set it (after registration, before the first step) to choose."""
        return self._seq.ordered

    @ordered.setter
    def ordered(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"ordered={value!r}: allowed True or False")
        self._seq.ordered = value

    @property
    def lanes(self) -> int:
        """How many buckets' exchanges can run at once (one process group each)."""
        return len(self._lanes)

    @property
    def step(self) -> int:
        """Optimizer steps whose communication has started."""
        return self._step + 1

    # ------------------------------------------------------------------ the work
    def begin(self, bucket: int) -> int:
        """Book-keeping on the caller's thread: the step counter. A step whose gradients held
        inf/NaN on some rank is not an optimizer step (a GradScaler skips it): without delay,
        the next step reuses its index, so schedules and random streams go on as if it
        never happened. Here, before any bucket of a step is queued, the adaptive warm-up
        decides whether the step is compressed (warmup.py)."""
        if bucket == 0:
            self.guard.settle()  # the previous step's exchanges are over
            if (self.guard.skipped is not None and self.guard.skipped == self._step
                    and not self.config.delay and self.reuse_skipped):
                self.guard.skipped = None
                self.telemetry.forget(self._step)
                self.warmup.redo(self._step)
            else:
                self._step += 1
            self.warmup.begin(max(self._step, 0), self._sum_window, self.telemetry.log_scalar)
        return max(self._step, 0)

    def _sum_window(self, acc: torch.Tensor, step: int) -> int:
        """The warm-up's one collective: its window's values summed over every rank (under
        HSDP the whole mesh, so the job switches at one step), issued while no exchange is in
        flight (the same program point on every rank). Returns how many ranks."""
        self.drain()
        group = self.stats_group if self.stats_group is not None else self.group
        world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        if world > 1:
            t = Traffic()
            collectives.all_reduce_now(acc, "sum", group, traffic=t)
            self.telemetry.add(step, t)
        return world

    def reduce(self, x: torch.Tensor, params: Sequence[ParamSlice], bucket: int = 0,
               param_tensors=None) -> torch.Tensor:
        """Synchronously reduce one flat bucket (any float dtype); returns the average in
        x's dtype. The DDP hook runs exactly this, on the communication thread."""
        step = self.begin(bucket)
        self.warmup.observe(step, x, params)
        live = self.compressor.live([base_name(p.name) for p in params])  # (HSDP: pieces)
        return self._reduce(self._lanes[0], Exchange(bucket, x, list(params), step,
                                                     params=param_tensors, live=live))

    def _reduce(self, lane, ex: Exchange):
        """One bucket's exchange on ``lane``, as stages (hooks/stages.py): unscale, the
        topology's split, the method (the warm-up's choice, Adam's transforms, the guard),
        rescale. ``ex.plain``: a reduce(x, ctx) run instead of the method's, without memory
        or guard (local_steps: an inner step's node average, the buffers' average)."""
        buf, step, scale = ex.buf, ex.step, ex.scale
        if ex.bucket == 0 and self.telemetry.logging:
            # the last step every exchange of which has finished by now
            self._write(step - 1 - self.config.delay)
        traffic = Traffic()
        for c in lane.comms():
            c.traffic = traffic
        x = buf if buf.dtype == torch.float32 else buf.float()
        if scale is not None:  # memory holds unscaled values: the loss scale may change
            x = x / scale
        t0, c0 = time.perf_counter(), time.thread_time()
        ctx, run = stages.split(self, lane, ex)
        if ex.plain is not None:
            out = run(x, ex.plain)
        elif self.compressor.stateless:
            out = run(x, self.compressor.reduce)
        else:
            out = stages.method(self, ctx, lane, x, run)
        ctx.finish(True)  # unguarded paths' memory_next buffers (the guard finished its own)
        if scale is not None:
            out = out * scale
        if out is not buf:
            buf.copy_(out)
        traffic.total_s += time.perf_counter() - t0
        traffic.total_cpu_s += time.thread_time() - c0
        self.telemetry.add(step, traffic, buf.numel() * buf.element_size(),
                           keep=step - self.config.delay - 4)
        return buf

    def set_topology(self, local_size: int, groups) -> None:
        """Hierarchical: ``local_size`` ranks per node; ``groups``: per lane, (the node's
        group, the group of this local index across nodes). Before the first exchange."""
        self.hierarchy.local_size = local_size
        for lane, (intra, inter) in zip(self._lanes, groups):
            lane.set_hierarchy(intra, inter)

    # ------------------------------------------------------------------ DDP side
    def submit_slices(self, bucket: int, buf: torch.Tensor, slices, tensors=None
                      ) -> torch.futures.Future:
        """Queue the exchange of a bucket laid out by ``slices`` (ParamSlices; ``tensors``:
        the parameters, where the method reads them) on the first lane, each its own round
        of the collective order; the future completes with the average, in ``buf``. What
        :meth:`reduce` does on the caller's thread, done on the lane's (the FSDP adapter's
        overlapped exchanges, which FSDP refuses delay and local steps for)."""
        try:
            step = self.begin(bucket)
        except Exception as exc:  # noqa: BLE001  (the caller's wait raises it)
            return self._failed(buf, exc)
        self.warmup.observe(step, buf, slices)
        live = self.compressor.live([base_name(p.name) for p in slices])
        ex = Exchange(bucket, buf, list(slices), step, params=tensors, live=live,
                      fut=_future(buf))
        self._enqueue(self._lanes[0], ex, True)
        return ex.fut

    def _failed(self, buf, exc: BaseException) -> torch.futures.Future:
        """A bucket's future that fails with ``exc`` (begin() raised: a step mismatch read
        late); every later exchange fails with it too."""
        self._error = exc
        fut = _future(buf)
        fut.set_exception(exc)
        return fut

    def submit(self, bucket: int, buf: torch.Tensor, params, last: bool = True
               ) -> torch.futures.Future:
        """Queue one bucket's exchange; the returned future completes with the average.
        ``last``: DDP's last bucket of this backward pass (it closes the round of the
        collective order). One of three ways, fixed by the config: an inner step of local
        steps (:meth:`_submit_inner`), an exchange the step waits for (:meth:`_submit_now`),
        delayed averaging (:meth:`_submit_delayed`)."""
        names = []
        for p in params:
            name = self.param_names.get(id(p))
            if name is None:
                raise RuntimeError(
                    "a bucket holds a parameter the state does not know: build the state with "
                    "the model it serves, gradcomp.State(method, config, model=net), or use "
                    "gradcomp.register(ddp_model, method, optimizer=opt)")
            names.append(name)
        slices = flat_slices(zip(names, params))
        if self.rounds.active:
            return self._submit_inner(bucket, buf, slices, last)
        try:
            step = self.begin(bucket)  # (the previous step's flags are read here)
        except Exception as exc:  # noqa: BLE001  (handed to DDP, as a lane's error is)
            return self._failed(buf, exc)
        scale = self._scale()
        self.warmup.observe(step, buf, slices, scale)
        if self.adam is not None and not self.warmup.dense(step):
            self.adam.scale(slices, buf.device)  # built here, while the optimizer is idle
        ex = Exchange(bucket, buf, slices, step, params=list(params), scale=scale,
                      live=self.compressor.live(names), fut=_future(buf))
        if self.trace is not None:
            now = time.perf_counter()
            self.trace.append(("submit", bucket, now, now))
        if not self.config.delay:
            return self._submit_now(ex, last)
        return self._submit_delayed(ex, names, last)

    def _submit_inner(self, bucket, buf, slices, last):
        """An inner step of local steps: this rank's gradient, or a hierarchy's node's."""
        if not self.rounds.bound:
            raise RuntimeError(f"local_steps={self.config.local_steps}: no optimizer to run "
                               f"the outer step from; build the state with gradcomp.register"
                               f"(model, ..., optimizer=opt) or call gradcomp.hooks.optimizer."
                               f"bind(state, opt, module=model.module, bucket_bytes="
                               f"model.bucket_bytes_cap) before training")
        fut = _future(buf)
        if not self.local_size:
            fut.set_result(buf)
            return fut
        lane = self._lanes[bucket % len(self._lanes)]
        self._enqueue(lane, Exchange(bucket, buf, slices, self.step, plain=node_average,
                                     fut=fut), last)
        return fut

    def _submit_now(self, ex: Exchange, last: bool):
        """The exchange on its lane; DDP waits for its future."""
        self._layouts[ex.bucket] = tuple(p.name for p in ex.slices)  # DDP's buckets, as seen
        self._enqueue(self._lanes[ex.bucket % len(self._lanes)], ex, last)
        return ex.fut

    def _submit_delayed(self, ex: Exchange, names, last: bool):
        """Delayed averaging: exchange a copy in the background, apply the local gradient now
        plus the correction (average - local) of step - D. The copy, and the parameters
        where the method reads them (DGC's weight decay), are taken now: the optimizer
        updates the parameters while the exchange runs."""
        buf, step, params = ex.buf, ex.step, ex.params
        layout = tuple(names)
        if self._layouts.get(ex.bucket) != layout and len(self._lanes) > 1:
            # DDP moved parameters between buckets (its rebuild): a parameter's previous
            # exchange may sit on another lane and must finish before its next one starts
            # (without delay every exchange of the previous step has finished already). Only
            # earlier steps': this step's may wait for this very bucket's turn.
            self.drain(before=step)
        self._layouts[ex.bucket] = layout
        if self.compressor.reads_params(ex.live):
            ex.params = [p.detach().clone() for p in params]
        ex.buf, ex.delayed, ex.scale = buf.clone(), True, None
        self._enqueue(self._lanes[ex.bucket % len(self._lanes)], ex, last)
        # (the job's wait orders after the lane's stream)
        self.delay.add(step, ex.slices, ex.fut, zip(names, params))
        corr = self.delay.take(step - self.config.delay, ex.slices, buf)
        if corr is not None:
            buf.add_(corr)
        fut = _future(buf)
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

    def _send_outer(self, bucket, x, slices, tensors, last, plain):
        """Local steps' outer exchange of one bucket (hooks/local_steps.py) in the global
        order: the method's (a step of its own), or ``plain``: the buffers' plain average.
        Returns (its future, its step)."""
        step = self.begin(bucket) if not plain else max(self._step, 0)
        if not plain:
            self.warmup.observe(step, x, slices)
        live = self.compressor.live([s.name for s in slices]) if not plain else None
        lane = self._lanes[bucket % len(self._lanes)]
        fut = torch.futures.Future(devices=[x.device] if x.is_cuda else None)
        self._enqueue(lane, Exchange(bucket, x, slices, step, params=tensors, live=live,
                                     plain=self.compressor.dense if plain else None, fut=fut),
                      last)
        return fut, step

    def bind_local(self, module: torch.nn.Module, bucket_bytes: int | None,
                   pieces=None) -> None:
        """``local_steps`` > 1: lay the outer buckets out (hooks/local_steps.py): every
        trainable parameter of ``module`` in module order, or ``pieces`` ((name, tensor)
        pairs: HSDP's rows of this rank); the optimizer's step hooks that end the rounds are
        installed by hooks/optimizer.py's ``bind``, which calls this."""
        if pieces is None:
            names = self.param_names
            pieces = [(names[id(p)], p) for p in module.parameters() if id(p) in names]
        self.rounds.bind(pieces, module.named_buffers(), bucket_bytes, self._send_outer)

    def drain(self, before: int | None = None) -> None:
        """Wait until every queued exchange (of the steps before ``before``) has finished."""
        self.rounds.drain(before)
        self.delay.drain(before)

    def flush(self) -> dict:
        """End of training. With ``delay``: wait for the exchanges still in flight and put the
        sum of their corrections into each parameter's ``.grad``; call ``optimizer.step()``
        once more after it and every averaged gradient has been applied. Returns the
        corrections by parameter name. With ``local_steps`` and ``local_delay=1``: wait for
        the outer exchange in flight and apply it to the parameters (and buffers) now;
        called at a round's end, every rank then holds the global point (no
        ``optimizer.step()`` after it). A no-op otherwise."""
        self.rounds.flush()
        return self.delay.flush()

    # ------------------------------------------------------------------ telemetry
    def attach(self, writer, details: bool = False) -> None:
        """Log per-step scalars to a TensorBoard ``SummaryWriter`` (or anything with
        ``add_scalar``): compression ratio, wire and sent bytes, the norm of each memory slot
        (residuals, velocities) and what the method records (DGC's sparsity and mean sampled
        threshold; with ``details`` also PowerSGD's relative approximation error and, for a
        method whose residual is its own message's error (``Compressor.residual_slot``:
        onebit's first stage, terngrad, topk, threshold), ``residual_energy``: ||residual after
        the step||^2 / ||gradient + residual before||^2, summed over the step's buckets, i.e.
        1 - delta of error feedback's contraction (at or above 1 the residual does not
        shrink); both cost passes over the gradient). Written from the communication thread
        when a step's exchanges have all finished; nothing is computed while no writer is
        attached."""
        self.telemetry.attach(writer, details, self._step)

    def _write(self, step: int) -> None:
        self.telemetry.write(step, self.memory, self.warmup.compressing(step))

    def stats(self) -> dict:
        """Bytes of the latest step: ``raw_bytes`` (the gradients' own size, what a plain
        allreduce hands over), ``sent_bytes`` (the messages this rank handed to collectives),
        ``wire_bytes`` / ``raw_wire_bytes`` (what ring-style collectives put on this rank's
        link for those two; ``intra_node_wire_bytes`` the part that stayed inside a node
        under a hierarchical topology, ``inter_node_wire_bytes`` the rest, which crossed
        between nodes (under a flat topology all of it may), their ``ratio``, the number of
        ``collectives``, and the seconds spent inside collectives (``comm_s``) and
        compressing/decompressing (``codec_s``), summed over the step's buckets, and
        ``codec_cpu_s``: the exchanging threads' CPU time outside collectives (``codec_s``
        is wall time: on cores shared with backward it also counts the waits for a core;
        this is what the codec took from them; on a GPU, the host's time). With
        ``delay=D`` the latest step whose exchanges have all finished is D steps back. The
        warm-up's schedule: ``compressing`` (whether the step in flight is compressed; False
        for plain allreduce), ``warmup_switch_step`` (the first compressed step; None while
        the adaptive rule has not decided) and ``warmup_norm_change`` (the adaptive rule's last
        window ratio r, None before two windows). ``topology``: "flat" or "hierarchical";
        ``topology_probe``: what ``topology=auto`` measured on several nodes (seconds per
        exchange of one bucket each way, the slowest rank's, and the choice), None where it
        did not run; ``method_probe``: what ``method="auto"`` measured (each candidate's
        seconds per exchange of the probe bucket, the choice, the predicted exchange seconds
        per step), None where it did not run.

        Over the run so far (every exchange recorded since this state was created: a
        checkpoint does not carry them, so a resumed job counts from its resumption):
        ``run_raw_bytes``, ``run_sent_bytes``, ``run_wire_bytes`` and ``run_ratio`` (raw /
        sent: the dense warm-up's steps weigh in), and
        ``compressing_since``: the first compressed step once the step in flight has
        reached it (None before the switch, and for plain allreduce)."""
        t, raw = self.telemetry.record(self._step - self.config.delay)
        run, run_raw = self.telemetry.totals()
        switch = self.warmup.switch_step()
        W = self.world_size
        raw_wire = raw * 2 * (W - 1) / W
        return {
            "step": self.step, "raw_bytes": raw, "sent_bytes": t.sent,
            "wire_bytes": t.wire, "raw_wire_bytes": raw_wire,
            "intra_node_wire_bytes": t.intra, "inter_node_wire_bytes": t.wire - t.intra,
            "ratio": raw / t.sent if t.sent else float("inf"),
            "collectives": t.collectives,
            "comm_s": t.comm_s, "codec_s": t.total_s - t.comm_s,
            "codec_cpu_s": t.total_cpu_s - t.comm_cpu_s,
            "compressing": bool(self.warmup.compressing(max(self._step, 0))),
            "warmup_switch_step": switch, "warmup_norm_change": self.warmup.ratio,
            "run_raw_bytes": run_raw, "run_sent_bytes": run.sent, "run_wire_bytes": run.wire,
            "run_ratio": run_raw / run.sent if run.sent else float("inf"),
            "compressing_since": switch if switch is not None and self._step >= switch else None,
            "topology": "hierarchical" if self.local_size else "flat",
            "topology_probe": self.topology_probe, "method_probe": self.method_probe,
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything needed to resume exactly (hooks/checkpoint.py assembles it)."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Load a checkpoint of :meth:`state_dict`: all of it, or (ValueError/TypeError naming
        what is wrong) nothing (hooks/checkpoint.py). Collective: call it on every rank, each
        with its own checkpoint; every rank loads or every rank raises."""
        checkpoint.load_state_dict(self, sd)

    @property
    def failed(self) -> BaseException | None:
        """The error an exchange of this state raised (every later one fails with it), None
        while none has."""
        return self._error

    def stateful(self) -> "checkpoint.DistributedCheckpoint":
        """This state for ``torch.distributed.checkpoint`` (a ``Stateful``)::

            dcp.save({"model": model, "optim": opt, "gradcomp": state.stateful()}, ...)

        Each rank's state is its own (residuals of its own gradients), so it goes in under a
        key of its rank, as one opaque entry (the bytes of ``state_dict()``): DCP would
        otherwise keep one rank's copy of equal keys, and could not load memory a fresh state
        has not created yet."""
        return checkpoint.DistributedCheckpoint(self)

    def all_ranks(self) -> "checkpoint.AllRanksCheckpoint":
        """This state for a framework's checkpoint that one rank writes and every rank
        loads (Lightning's, Accelerate's ``save_state``, the HF Trainer's)::

            accelerator.register_for_checkpointing(state.all_ranks())

        Its ``state_dict()`` is collective (every rank calls it, as those frameworks do):
        each rank's state is gathered onto global rank 0, whose copy holds all of them;
        ``load_state_dict()`` on every rank takes its own rank's from that copy."""
        return checkpoint.AllRanksCheckpoint(self)

    memory_names = staticmethod(checkpoint.memory_names)

    # ------------------------------------------------------------------ Adam
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
        if (self.compressor.stateless or self.config.adam == "off" or self.rounds.active
                or not optimizer_binding.is_adam(optimizer)):
            return
        names = self.param_names
        mode = self.adam_mode()
        self.adam = optimizer_binding.FrozenVariance(
            optimizer, lambda p: id(p) in names and self.compressor.compresses(names[id(p)],
                                                                               tuple(p.shape)),
            lambda: not self.warmup.dense(max(self._step, 0)), names,
            precondition=mode == "precondition", momentum=mode == "momentum",
            store=self.memory)

    def dense_wire(self) -> str:
        """What the warm-up's dense steps put on the wire (``dense_wire``; "auto": bfloat16
        with Adam/AdamW bound, else float32)."""
        w = self.config.dense_wire
        if w == "auto":
            return "bfloat16" if self.adam is not None else "float32"
        return w

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
        self.guard.settle()
        destroy_groups(self.owned_groups)
        self.plan = dataclasses.replace(self.plan, owned_groups=(), stats_group=None,
                                        load_group=None)
        self.compressor.unbind()
        if self.adam is not None:
            self.adam.close()
            self.adam = None
        self.rounds.close()
        for undo in self._detach:  # an adapter's own hooks (hooks/fsdp.py)
            undo()
        self._detach = []
        self.group = None
        self.telemetry.close(self._step, self.memory, self.warmup.compressing)

    def _put(self, lane: Lane, job) -> None:
        if lane.put(job):
            _LIVE.add(self)

    def _worker(self, lane: Lane):
        while True:
            ex = lane.queue.get()
            if ex is None:
                return
            buf, fut, delayed = ex.buf, ex.fut, ex.delayed
            if self._seq.ordered is None:  # decided once, before any collective is issued
                self._seq.ordered = not all(ln.gloo() for ln in self._lanes)
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


def _future(buf: torch.Tensor) -> torch.futures.Future:
    """A future for a bucket's result (on CUDA it records the buffer's device)."""
    return torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)


def destroy_groups(groups) -> None:
    """Destroy the process groups register created (a refusal, or the state's close())."""
    for g in groups:
        if isinstance(g, dist.ProcessGroup) and dist.is_initialized():
            try:
                dist.destroy_process_group(g)
            except (RuntimeError, ValueError, KeyError):
                pass  # already gone with the default group
    if isinstance(groups, list):  # a registration's list: not destroyed twice
        groups.clear()
