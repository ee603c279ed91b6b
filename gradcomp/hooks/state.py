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
  adam         optimizer/adam.py the Adam binding (frozen variance, the momentum exchange)
  engine       engine.py        lanes (threads, process groups, CUDA streams) and the one
                                global order in which every collective is issued

A checkpoint is assembled from the components' own ``state_dict()`` and this state's
``identity()`` (checkpoint.py lays it out, checks a loaded one and runs the collective load).
This module ties them together, building two parts with the components each uses:
``entries`` (hooks/submit.py's :class:`Entries`, on DDP's thread: the step counter, then one
of three ways onto a lane) and ``stages`` (hooks/stages.py's :class:`Stages`, on a lane: the
stages of one bucket's exchange). The hook returns a future at once: backward never waits
on the network.
"""
from __future__ import annotations

import atexit
import dataclasses
import weakref
from functools import partial
from typing import Sequence

from ..comm import Comm
from ..compressors.base import build
from ..config import Adam, MethodConfig
from ..memory import ParamMemory
from . import checkpoint
from . import optimizer as optimizer_binding
from .agree import destroy_groups
from .delayed import Delayed
from .engine import Engine
from .guard import Guard
from .local_steps import LocalSteps
from .plan import Plan, Sharding, from_model
from .stages import Stages
from .submit import Entries
from .telemetry import Telemetry
from .topology import Hierarchy
from .warmup import Warmup, window_sum

_LIVE: "weakref.WeakSet[HookState]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for state in list(_LIVE):
        state.close()


def _planned(field: str, doc: str) -> property:
    """A read-only attribute of the state that is a field of its plan (hooks/plan.py)."""
    return property(lambda self: getattr(self.plan, field), doc=doc)


class HookState:
    """Everything one registered hook owns: private to the library, behind the user's
    :class:`hooks.public.State` (what :func:`gradcomp.register` returns and
    ``gradcomp.State(...)`` builds, with these arguments)."""

    def __init__(self, method: str, config: MethodConfig | None = None, *, group=None,
                 lane_groups: Sequence = (), param_names: dict[int, str] | None = None,
                 param_numels: dict[str, int] | None = None, model=None,
                 plan: Plan | None = None):
        """``plan``: what a registration decided (hooks/plan.py; its ``lane_groups`` and
        ``owned_groups`` join these). ``model``: the module (DDP-wrapped or not) whose
        parameters the state will see; their names key its memory. Needed where the hook is registered by hand
        (``ddp.register_comm_hook(gradcomp.State("onebit", model=net), gradcomp.hook)``),
        which then also creates the state's own process group (collective: on every rank).
        :func:`gradcomp.register` does both itself, and binds the optimizer (``dgc``, Adam)."""
        owned = []
        if model is not None:
            param_names, param_numels, group, owned = from_model(model, group)
        config, self.compressor = build(method, config)
        self.method, self.config = method, config
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
        # the components
        self.memory = ParamMemory()
        self.guard = Guard(self.memory)
        self.warmup = Warmup(config, self.compressor.stateless)
        self.delay = Delayed()
        self.rounds = LocalSteps(config)
        self.telemetry = Telemetry()
        self.hierarchy = Hierarchy()
        self.adam = None  # the Adam binding (hooks/optimizer/adam.py), once bound
        self._setup_runtime()
        if plan.topology is not None:
            self.set_topology(*plan.topology)

    # ------------------------------------------------------------------ the plan's parts
    scaler = _planned("scaler", "The GradScaler whose loss scale the gradients carry.")
    stats_group = _planned("stats_group", "The warm-up's statistics' group (HSDP).")
    owned_groups = _planned("owned_groups", "Process groups destroyed at close().")
    load_group = _planned("load_group", "The loads' agreement (checkpoint.py's load_group).")
    sharded = _planned("sharding", "The Sharding the state serves (false for DDP).")
    reuse_skipped = _planned("reuse_skipped", "Whether a skipped step's index is taken again.")
    topology_probe = _planned("topology_probe", "topology=auto's measurement, if it ran.")
    method_probe = _planned("method_probe", "method=auto's measurement, if it ran.")

    # ------------------------------------------------------------------ runtime
    def _setup_runtime(self):
        # under HSDP the first lane's inf/NaN flag goes round the whole mesh (a shard's
        # replicas alone would leave the other shards waiting)
        flags = self.plan.stats_group if self.plan.sharding == Sharding.HSDP else None
        self.stages = Stages(config=self.config, compressor=self.compressor, memory=self.memory,
                             telemetry=self.telemetry, warmup=self.warmup, guard=self.guard,
                             rounds=self.rounds, hierarchy=self.hierarchy,
                             adam=lambda: self.adam)
        self.engine = Engine(self.stages.exchange, self.method, [self.group, *self._lane_groups],
                             flags, on_start=lambda: _LIVE.add(self))
        self.entries = Entries(
            config=self.config, compressor=self.compressor, warmup=self.warmup,
            telemetry=self.telemetry, rounds=self.rounds, delay=self.delay,
            hierarchy=self.hierarchy, engine=self.engine, stages=self.stages,
            names=self.param_names, begin=self.begin, step=lambda: self.step,
            scaler=lambda: self.scaler, adam=lambda: self.adam, drain=self.drain)

    def __getstate__(self):
        """Pickled without its runtime (process groups, threads, the model's tensors, the
        optimizer's hooks): the exchanges in flight are waited for first."""
        self.drain()
        d = self.__dict__.copy()
        for k in ("group", "_lane_groups", "engine", "stages", "entries", "param_names", "adam",
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
        return self.engine.lanes[0].comm.world_size

    @property
    def rank(self) -> int:
        """This rank's index in the state's group."""
        return self.engine.lanes[0].comm.rank

    @property
    def flat_comm(self) -> Comm:
        """The first lane's collectives over every rank of the group (the guard's flag)."""
        return self.engine.lanes[0].comm

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
    def lanes(self) -> int:
        """How many buckets' exchanges can run at once (one process group each)."""
        return len(self.engine.lanes)

    @property
    def layouts(self) -> dict[int, tuple]:
        """DDP's buckets as the state last saw them: bucket index -> its parameters' names."""
        return self.entries.way.layouts

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
            group = self.stats_group if self.stats_group is not None else self.group
            self.warmup.begin(max(self._step, 0),
                              partial(window_sum, drain=self.drain, group=group,
                                      telemetry=self.telemetry),
                              self.telemetry.log_scalar)
        return max(self._step, 0)

    def set_topology(self, local_size: int, groups) -> None:
        """Hierarchical: ``local_size`` ranks per node; ``groups``: per lane, (the node's
        group, the group of this local index across nodes). Before the first exchange."""
        self.hierarchy.local_size = local_size
        self.engine.set_topology(groups)

    def drain(self, before: int | None = None) -> None:
        """Wait until every queued exchange (of the steps before ``before``) has finished."""
        self.rounds.drain(before)
        self.delay.drain(before)

    @property
    def failed(self) -> BaseException | None:
        """The error an exchange of this state raised (every later one fails with it), None
        while none has."""
        return self.engine.error

    # ------------------------------------------------------------------ checkpoints
    def identity(self) -> checkpoint.Identity:
        """What this state's checkpoint records of it and a load compares (checkpoint.py)."""
        return checkpoint.Identity(
            method=self.method, config=self.config, world_size=self.world_size,
            rank=checkpoint.job_rank(self.rank), local_size=self.local_size,
            names=tuple(self.param_names.values()), numels=self.param_numels,
            scalar_slots=frozenset(self.compressor.scalar_slots),
            exchanges=checkpoint.exchanged(self.adam_mode if self.adam is not None
                                           else Adam.OFF),
            adam_running=self.adam_mode.value, auto=self.method_probe is not None,
            memory=self.memory, rounds=self.rounds)

    def state_dict(self) -> dict:
        """Everything needed to resume this state exactly (docs/checkpoints.md), from its
        components' own ``state_dict()``: memory by parameter name (memory.py), the step
        counter, the delayed exchanges still to be applied (delayed.py), with local_steps
        the rounds' state (local_steps.py) and the adaptive warm-up's (warmup.py); laid out
        by checkpoint.py's ``assemble``. The exchanges in flight are waited for first (they
        write the memory), and a skipped step's leave no trace in it."""
        self._settle()
        return checkpoint.assemble(self.identity(), self.step, {
            "memory": self.memory.state_dict(), "pending": self.delay.state_dict(),
            "local": self.rounds.state_dict(), "warmup": self.warmup.state_dict()})

    def load(self, read) -> None:
        """Load the checkpoint ``read()`` returns, on every rank (checkpoint.py's ``load``:
        all of it or nothing, over the loads' own group)."""
        group = self.load_group if self.load_group is not None else (
            self.stats_group if self.stats_group is not None else self.group)
        checkpoint.load(read, group=group, settle=self._settle, identity=self.identity,
                        restore=self._restore)

    def _settle(self) -> BaseException | None:
        """Before a save or a load: the exchanges in flight finished, the copies the guard
        holds (of the memory being saved or replaced) dropped; the error an exchange raised,
        if one did."""
        self.drain()
        self.guard.settle()
        return self.failed

    def _restore(self, sd: dict) -> None:
        """Hand each component its part of a checked checkpoint."""
        self.memory.load_state_dict(sd["memory"])
        if self.adam is not None:
            self.adam.reset()
        self.resume_at(sd["step"])
        self.delay.load_state_dict(sd.get("pending", []))
        self.rounds.load_state_dict(sd.get("local"))
        self.warmup.load_state_dict(sd.get("warmup"))

    # ------------------------------------------------------------------ Adam
    @property
    def adam_mode(self):
        """What ``adam`` runs with Adam/AdamW (hooks/optimizer/adam.py's ``adam_mode``)."""
        return optimizer_binding.adam_mode(self.config, self.compressor, self.sharded)

    def bind_adam(self, optimizer) -> None:
        """With Adam/AdamW and ``adam`` on: freeze Adam's second moment for the compressed
        parameters once compression starts (hooks/optimizer/); else nothing changes."""
        adam = optimizer_binding.frozen_variance(
            optimizer, config=self.config, names=self.param_names, compressor=self.compressor,
            memory=self.memory, sharded=self.sharded, rounds=self.rounds,
            compressing=lambda: not self.warmup.dense(max(self.step - 1, 0)))
        if adam is not None:
            self.adam = adam

    def bind_optimizer(self, optimizer, *, module=None, bucket_bytes=None, pieces=None,
                       warn: bool = False, stacklevel: int = 4, outer_optimizer=None) -> None:
        """Attach to the user's optimizer all that the settings need, once every rank agreed
        (the adapters call this last; hooks/optimizer/ holds each piece): with
        ``local_steps`` the rounds' step hooks (hooks/local_steps.py); else the SGD momentum
        a method applies itself (DGC), the Adam binding and, with ``warn``, the
        measured-accuracy warning. ``pieces``: what the rounds average under HSDP: (name,
        tensor) pairs of this rank's rows; ``outer_optimizer``: the rounds' outer step."""
        if optimizer is None:
            return
        if self.rounds.active:  # inner steps are the optimizer's own; rounds end in its hooks
            if pieces is None:  # every trainable parameter of ``module`` in module order
                names = self.param_names
                pieces = [(names[id(p)], p) for p in module.parameters() if id(p) in names]
            self.rounds.bind(pieces, module.named_buffers(), bucket_bytes, self.entries.outer,
                             outer_optimizer)
            # (a pre-hook that runs before the rounds')
            self.on_close(optimizer_binding.check_first_round(
                self.rounds, optimizer, self.load_group, self.param_numels))
            # the steps that run (not a wrapper's skips)
            self.rounds.hook(optimizer_binding.step_hooks(
                optimizer, "local", self.rounds.inner_pre, self.rounds.inner_post))
            self.bind_adam(optimizer)  # with sync_steps: the second moment they learned
            return
        optimizer_binding.bind_momentum(self.compressor, optimizer, self.param_names,
                                        self.method)
        self.bind_adam(optimizer)
        if warn:
            optimizer_binding.warn_measured(self.method, self.config, self.adam_mode,
                                            optimizer, stacklevel=stacklevel)

    def refuse_unseen_adam(self) -> None:
        """Registered without ``optimizer=``: Adam/AdamW stepping the model's parameters
        raises at its first step (hooks/optimizer/'s ``refuse_unseen_adam``)."""
        ref = weakref.ref(self)  # (the global hook holds no state alive)
        remove = optimizer_binding.refuse_unseen_adam(
            self.method, self.compressor, self.config,
            lambda: getattr(ref(), "param_names", None))
        if remove is not None:
            self.on_close(remove)

    def close(self) -> None:
        """Stop the communication threads (after the exchanges queued so far). Called at
        interpreter exit for every state, so no thread still holds a process group while
        it is destroyed. An attached writer gets the scalars of the steps finished since
        the last write (they otherwise go out with the next step's first exchange) and is
        flushed."""
        self.engine.close()
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
