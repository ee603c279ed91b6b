"""Delayed averaging (Zhu et al., "Delayed Gradient Averaging", NeurIPS 2021): the hook
returns the local gradient at once plus the correction (average - local) of step t - D; the
exchanges owed are kept per parameter, so they survive DDP's bucket rebuilds and go into
checkpoints."""
from __future__ import annotations

import torch

from ..compressors.base import ParamSlice


def flat_slices(named) -> list[ParamSlice]:
    """Flat layout of (name, tensor) pairs laid end to end."""
    out, off = [], 0
    for name, t in named:
        out.append(ParamSlice(name, tuple(t.shape), off, t.numel()))
        off += t.numel()
    return out


class _Pending:
    """One delayed exchange: its step, the layout it was sent in, and its correction."""

    def __init__(self, step: int, slices, job: torch.futures.Future):
        self.step, self.slices, self.job, self.taken = step, slices, job, set()

    def wait(self) -> torch.Tensor:
        return self.job.wait()

    def owed(self):
        """(name, correction) for each parameter whose correction is not yet applied."""
        corr = self.wait()
        for s in self.slices:
            if s.name not in self.taken:
                yield s.name, corr[s.offset : s.offset + s.numel]

    @classmethod
    def done(cls, step: int, corrections: dict) -> "_Pending":
        slices = flat_slices(corrections.items())
        fut = torch.futures.Future()
        fut.set_result(torch.cat([c.reshape(-1) for c in corrections.values()])
                       if corrections else torch.zeros(0))
        return cls(step, slices, fut)


class Delayed:
    """A component of the state: the exchanges still owed (oldest first) and the parameters
    their corrections go to at ``flush``."""

    def __init__(self):
        self._pending: list[_Pending] = []
        self._params: dict[str, torch.Tensor] = {}  # by name: where flush() writes

    def __getstate__(self):  # waited for (futures do not pickle); no parameters
        return {"pending": self.state_dict()}

    def __setstate__(self, d):
        self.__init__()
        self.load_state_dict(d["pending"])

    def add(self, step: int, slices, job: torch.futures.Future, params) -> None:
        """An exchange of ``step`` started: ``job`` completes with its correction; ``params``
        (name, tensor) receive it at ``flush``."""
        self._pending.append(_Pending(step, slices, job))
        for name, p in params:
            self._params[name] = p

    def take(self, step: int, slices, like: torch.Tensor):
        """The corrections of ``step`` for the parameters in ``slices``, in their layout."""
        found = {}
        for e in self._pending:
            if e.step == step:
                corr = e.wait()
                for s in e.slices:
                    if s.name not in e.taken:
                        found[s.name] = (e, corr[s.offset : s.offset + s.numel])
        if not found:
            return None
        out = torch.zeros_like(like)
        for s in slices:
            hit = found.get(s.name)
            if hit is not None:
                out[s.offset : s.offset + s.numel] = hit[1]
                hit[0].taken.add(s.name)
        self._pending = [e for e in self._pending if len(e.taken) < len(e.slices)]
        return out

    def drain(self, before: int | None = None) -> None:
        """Wait until every exchange owed (of the steps before ``before``) has finished."""
        for e in self._pending:
            if before is None or e.step < before:
                e.wait()

    def flush(self) -> dict:
        """Wait for the exchanges still in flight and put the sum of their corrections into
        each parameter's ``.grad``; returns the corrections by parameter name."""
        total: dict[str, torch.Tensor] = {}
        for e in self._pending:
            for name, c in e.owed():
                total[name] = total[name] + c if name in total else c.clone()
        self._pending = []
        for name, c in total.items():
            p = self._params.get(name)
            if p is not None:
                p.grad = c.to(p.dtype).reshape(p.shape).clone()
        return total

    def state_dict(self) -> list:
        """The corrections still owed, per step (waited for)."""
        return [{"step": e.step, "corrections": {n: c.clone() for n, c in e.owed()}}
                for e in self._pending]

    def load_state_dict(self, pending: list) -> None:
        self._pending = [_Pending.done(p["step"], p["corrections"]) for p in pending]
