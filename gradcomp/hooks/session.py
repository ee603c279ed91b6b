"""The session: what :func:`gradcomp.register` returns and ``gradcomp.State(...)`` builds, the
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
from . import submit as submitting
from .state import HookState
from .telemetry import attach_writer, state_stats


class Session:
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
        return f"gradcomp.Session(method={self.method!r}, step={self.step})"

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
        """What the method has done, in optimizer steps: bytes on the wire, time, the
        warm-up (docs/troubleshooting.md's table describes every key)."""
        return state_stats(self._state)

    def attach(self, writer, details: bool = False) -> None:
        """Log per-step scalars to a TensorBoard ``SummaryWriter`` (or anything with
        ``add_scalar``); ``details``: each memory slot's norm too (hooks/telemetry.py)."""
        attach_writer(self._state, writer, details)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's checkpoint (docs/checkpoints.md)."""
        return checkpoint.state_dict(self._state)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint written by ``state_dict()`` (collective: on every rank): all
        of it, or nothing and an error naming what is wrong."""
        checkpoint.load_state_dict(self._state, state_dict)

    def stateful(self):
        """This session as a torch.distributed.checkpoint ``Stateful``."""
        return checkpoint.stateful(self._state)

    def all_ranks(self):
        """This session for a framework's checkpoint that rank 0 writes and every rank
        loads (Lightning's, Accelerate's, the HF Trainer's)."""
        return checkpoint.all_ranks(self._state)

    # ------------------------------------------------------------------ the exchanges
    def flush(self) -> dict:
        """End of training: wait for what is in flight and apply what is owed (delayed
        averages' corrections, local steps' last exchange); docs/delay-and-local-steps.md."""
        return submitting.flush(self._state)

    def close(self) -> None:
        """Stop the communication threads after the exchanges queued so far."""
        self._state.close()

    def reduce(self, x, params, bucket: int = 0):
        """Synchronously exchange one flat bucket ``x`` laid out by ``params`` (ParamSlices);
        returns the average in x's dtype: what the DDP hook does to a bucket."""
        return self._state.reduce(x, params, bucket)

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


def state_of(obj) -> HookState:
    """The hook state of a session (or the hook state itself): what ``gradcomp.hook`` and the
    adapters work on."""
    return obj._state if isinstance(obj, Session) else obj
