"""The user's state: what :func:`gradcomp.register` returns and ``gradcomp.State(...)`` builds, the
user's side of a registered method and nothing else. Its public names are the whole API
(docs/reference.md lists them; tests/test_design.py holds the list):

  config, method, step, failed           what runs, how far it got, the error that stopped it
  stats()                                counters: bytes on the wire, time, the warm-up
  attach(writer)                         TensorBoard scalars
  state_dict(), load_state_dict(sd)      a checkpoint, one per rank (docs/checkpoints.md)
  stateful(), all_ranks()                the same as a torch.distributed.checkpoint Stateful,
                                         or every rank's gathered onto rank 0
  flush(), close()                       finish what is owed (delay, local steps); stop
  reduce(x, params)                      one bucket's exchange by hand, on the caller's thread
  ordered, trace                         the collective order's choice; an event trace

The hook state behind it (hooks/state.py: the engine, the components, the adapters' entries)
is private: ``gradcomp.hook`` and the adapters reach it, a user does not.
"""
from __future__ import annotations

from . import checkpoint
from .state import HookState


class State:
    """A registered method. ``gradcomp.State(method, config, model=net)`` builds one for a
    hook registered by hand (``ddp.register_comm_hook(state, gradcomp.hook)``): the arguments
    are :class:`hooks.state.HookState`'s."""

    __slots__ = ("_state", "__weakref__")

    def __init__(self, method: str | HookState, config=None, **kwargs):
        """``method``: a method's name (with ``config`` and HookState's other arguments), or
        the hook state an adapter built (hooks/register.py)."""
        self._state = (method if isinstance(method, HookState)
                       else HookState(method, config, **kwargs))

    def __repr__(self) -> str:
        return f"gradcomp.State(method={self.method!r}, step={self.step})"

    # ------------------------------------------------------------------ what runs
    @property
    def config(self):
        """The method's config (gradcomp/config.py), every option resolved."""
        return self._state.config

    @property
    def method(self) -> str:
        return self._state.method

    @property
    def step(self) -> int:
        """Optimizer steps whose communication has started."""
        return self._state.step

    @property
    def failed(self) -> BaseException | None:
        """The error an exchange raised (every later one fails with it), None while none has."""
        return self._state.failed

    # ------------------------------------------------------------------ telemetry
    def stats(self) -> dict:
        """What the method has done, counted in optimizer steps (calls of ``optimizer.step()``)
        for every method, ``local_steps`` included; docs/troubleshooting.md's table describes
        every key. The latest exchange's bytes (with ``local_steps`` the latest round's, with
        ``delay=D`` the step D back): ``raw_bytes`` (the gradients' own), ``sent_bytes``
        (handed to collectives), ``wire_bytes`` (on this rank's link: a ring allreduce
        2(W-1)/W of a message, an allgather (W-1), an all-to-all (W-1)/W), their split inside
        and between nodes, ``ratio``, collectives and seconds. ``step`` (``rounds``: outer
        rounds started), the warm-up's ``compressing``, ``warmup_switch_step`` (the optimizer
        step compression starts at; with local steps where the first compressed round begins,
        after ``sync_steps``), ``compressing_since`` (that step once reached), the probes'
        measurements. Over the run since this state was created (a resumed job counts from its
        resumption): ``run_raw_bytes`` (every optimizer step's gradients: what plain DDP's
        allreduce hands over), ``run_sent_bytes``, ``run_wire_bytes`` (every exchange's, the
        dense warm-up's and ``sync_steps``' included), ``run_raw_wire_bytes`` (a ring allreduce
        of the raw bytes) and ``run_ratio`` = ``run_raw_wire_bytes / run_wire_bytes``, the
        figure bench/RESULTS.md reports (in one process, with no wire: raw / sent)."""
        return _stats(self._state)

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
        self._state.telemetry.attach(writer, details, self._state.step - 1)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's checkpoint (docs/checkpoints.md)."""
        return self._state.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint written by ``state_dict()`` (collective: on every rank): all
        of it, or nothing and an error naming what is wrong."""
        self._state.load(lambda: state_dict)

    def stateful(self) -> checkpoint.DistributedCheckpoint:
        """This state for ``torch.distributed.checkpoint`` (a ``Stateful``)::

            dcp.save({"model": model, "optim": opt, "gradcomp": state.stateful()}, ...)

        Each rank's state is its own (residuals of its own gradients), so it goes in under
        a key of its rank, as one opaque entry (the bytes of ``state_dict()``): DCP would
        otherwise keep one rank's copy of equal keys, and could not load memory a fresh
        state has not created yet."""
        st = self._state
        return checkpoint.DistributedCheckpoint(st.state_dict, st.load,
                                                lambda: checkpoint.job_rank(st.rank))

    def all_ranks(self) -> checkpoint.AllRanksCheckpoint:
        """This state for a framework's checkpoint that one rank writes and every rank
        loads (Lightning's, Accelerate's ``save_state``, the HF Trainer's)::

            accelerator.register_for_checkpointing(state.all_ranks())

        Its ``state_dict()`` is collective (every rank calls it, as those frameworks do):
        each rank's state is gathered onto global rank 0, whose copy holds all of them;
        ``load_state_dict()`` on every rank takes its own rank's from that copy."""
        return checkpoint.AllRanksCheckpoint(self._state.state_dict, self._state.load)

    # ------------------------------------------------------------------ the exchanges
    def flush(self) -> dict:
        """End of training. With ``delay``: wait for the exchanges still in flight and put
        the sum of their corrections into each parameter's ``.grad``; call
        ``optimizer.step()`` once more after it and every averaged gradient has been
        applied. Returns the corrections by parameter name. With ``local_steps`` and
        ``local_delay=1``: wait for the outer exchange in flight and apply it to the
        parameters (and buffers) now; called at a round's end, every rank then holds the
        global point (no ``optimizer.step()`` after it). A no-op otherwise."""
        self._state.rounds.flush()
        return self._state.delay.flush()

    def close(self) -> None:
        """Stop the communication threads after the exchanges queued so far."""
        self._state.close()

    def reduce(self, x, params, bucket: int = 0):
        """Synchronously exchange one flat bucket ``x`` laid out by ``params`` (ParamSlices);
        returns the average in x's dtype: what the DDP hook does to a bucket."""
        return self._state.entries.reduce(x, params, bucket)

    @property
    def ordered(self) -> bool | None:
        """Whether collectives take turns in one global order, the same on every rank (what
        NCCL needs; hooks/engine.py): decided at the first exchange, False where every
        lane's process groups are gloo (which needs no order across groups), True
        otherwise; None until then. Set it (after registration, before the first step) to
        choose."""
        return self._state.engine.seq.ordered

    @ordered.setter
    def ordered(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"ordered={value!r}: allowed True or False")
        self._state.engine.seq.ordered = value

    @property
    def trace(self) -> list | None:
        """Set to [] to record (event, bucket, start, end) times of the exchanges; None:
        off."""
        return self._state.engine.trace

    @trace.setter
    def trace(self, value: list | None) -> None:
        self._state.engine.trace = value


def _stats(state) -> dict:
    """State.stats of the hook state ``state``: its components' counters."""
    tel, last = state.telemetry, state.step - 1
    t, raw = tel.record(last - state.config.delay)
    run, run_raw = tel.totals()
    step, run_raw, switch, started, compressing = _in_optimizer_steps(state, run_raw)
    W = state.world_size
    ring = 2 * (W - 1) / W
    if run.wire:
        run_ratio = run_raw * ring / run.wire
    else:
        run_ratio = run_raw / run.sent if run.sent else float("inf")
    out = {
        "step": step, "raw_bytes": raw, "sent_bytes": t.sent,
        "wire_bytes": t.wire, "raw_wire_bytes": raw * ring,
        "intra_node_wire_bytes": t.intra, "inter_node_wire_bytes": t.wire - t.intra,
        "ratio": raw / t.sent if t.sent else float("inf"),
        "collectives": t.collectives,
        "comm_s": t.comm_s, "codec_s": t.total_s - t.comm_s,
        "codec_cpu_s": t.total_cpu_s - t.comm_cpu_s,
        "compressing": compressing,
        "warmup_switch_step": switch, "warmup_norm_change": state.warmup.ratio,
        "run_raw_bytes": run_raw, "run_sent_bytes": run.sent, "run_wire_bytes": run.wire,
        "run_raw_wire_bytes": run_raw * ring, "run_ratio": run_ratio,
        "compressing_since": switch if started else None,
        "topology": "hierarchical" if state.local_size else "flat",
        "topology_probe": state.topology_probe, "method_probe": state.method_probe,
    }
    if state.rounds.active:
        out["rounds"] = state.step
        out["round_length"], out["at_round_edge"] = state.rounds.edge()
    return out


def _in_optimizer_steps(state, run_raw: int):
    """(optimizer steps taken, the run's raw bytes, the optimizer step compression starts
    at, whether the run has reached it, whether the step in flight is compressed). With
    local steps the state's steps and the warm-up count rounds, and the raw bytes are one
    gradient per optimizer step (those the adapter was handed), not one per round."""
    last, switch = state.step - 1, state.warmup.switch_step()
    if not state.rounds.active:
        started = switch is not None and last >= switch
        return state.step, run_raw, switch, started, bool(state.warmup.compressing(max(last, 0)))
    step = state.rounds.inner
    if switch is not None:
        switch = state.rounds.optimizer_step_of(switch)
    started = switch is not None and step - 1 >= switch
    return step, state.telemetry.handed(), switch, started, started


def state_of(obj) -> HookState:
    """The hook state of a gradcomp.State (or the hook state itself): what ``gradcomp.hook`` and the
    adapters work on."""
    return obj._state if isinstance(obj, State) else obj
