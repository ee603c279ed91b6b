"""Telemetry: per-step byte and time counters (``stats()``) and TensorBoard scalars."""
from __future__ import annotations

import threading

import torch

from ..comm import Traffic


def sq_norm(x, params, views) -> torch.Tensor:
    """Squared norm of x + the memory ``views`` (None: zero) over ``params``; x None: of the
    views alone."""
    total = torch.zeros((), dtype=torch.float64)
    for p, v in zip(params, views):
        part = x[p.offset : p.offset + p.numel] if x is not None else None
        if v is not None:
            part = v if part is None else part + v
        if part is not None:
            total = total + part.double().square().sum().cpu()
    return total


class Telemetry:
    """A component of the state: what each step cost (bytes, collectives, seconds) and what
    the method logged, written to a TensorBoard writer once a step's exchanges have all
    finished, and the same counters summed over the run (since this object was created: a
    checkpoint does not carry them). Thread-safe: the lanes record, the caller's thread
    reads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._records: dict[int, list] = {}  # step -> [Traffic, raw bytes], summed over buckets
        self._logs: dict = {}  # step -> key -> (sum, count) of what methods logged
        self._written = -1     # the last step whose scalars went to the writer
        self._run = [Traffic(), 0]  # every exchange's so far (a step run again included: its
        # bytes did cross); host integers the lanes already hold, so no device sync
        self._handed = 0  # local steps: the gradients' bytes of every optimizer step
        self.writer = None
        self.details = False

    def __getstate__(self):
        d = self.__dict__.copy()
        del d["_lock"]
        d["writer"] = None
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def attach(self, writer, details: bool, step: int) -> None:
        """Log per-step scalars from now on (``step``: the step in flight; the earlier ones
        logged nothing). See ``State.attach``."""
        self.writer, self.details = writer, details
        self._written = max(self._written, step - 1)

    @property
    def logging(self) -> bool:
        """Whether a writer is attached (nothing is computed for it otherwise)."""
        return self.writer is not None

    def log(self, step: int, key: str, value) -> None:
        """Record ``value`` for ``step``; the mean over the step's buckets is written."""
        if self.writer is None:
            return
        with self._lock:
            logs = self._logs.setdefault(step, {})
            total, n = logs.get(key, (0.0, 0))
            logs[key] = (total + value, n + 1)

    def log_ratio(self, step: int, key: str, num, den) -> None:
        """Record num / den for ``step``, both summed over the step's buckets first (so a
        large bucket weighs by its size, not as one of many)."""
        if self.writer is None:
            return
        with self._lock:
            logs = self._logs.setdefault(step, {})
            a, b = logs.get(key, (0.0, 0.0))
            logs[key] = (a + num, b + den)

    def log_scalar(self, step: int, key: str, value: float) -> None:
        """Record ``value`` for ``step``, once (not a mean over buckets)."""
        self.log_ratio(step, key, value, 1.0)

    def add(self, step: int, traffic: Traffic, raw: int = 0, keep: int | None = None) -> None:
        """Add one exchange's (or collective's) traffic and raw bytes to ``step``; records
        older than ``keep`` are dropped."""
        with self._lock:
            rec = self._records.setdefault(step, [Traffic(), 0])
            rec[0].merge(traffic)
            rec[1] += raw
            self._run[0].merge(traffic)
            self._run[1] += raw
            if keep is not None:
                for old in [k for k in self._records if k < keep]:
                    del self._records[old]

    def hand(self, nbytes: int) -> None:
        """Local steps: the adapter was handed ``nbytes`` of an optimizer step's gradients
        (what plain DDP would all-reduce; the run's raw bytes count these, not the rounds'
        pseudo-gradients)."""
        with self._lock:
            self._handed += nbytes

    def handed(self) -> int:
        """The gradients' bytes handed over so far (:meth:`hand`)."""
        with self._lock:
            return self._handed

    def forget(self, step: int) -> None:
        """``step`` runs again (its gradients were not finite): drop what it recorded."""
        with self._lock:
            self._records.pop(step, None)
            self._logs.pop(step, None)

    def record(self, step: int):
        """(Traffic, raw bytes) of ``step``."""
        with self._lock:
            return self._records.get(step) or [Traffic(), 0]

    def totals(self):
        """(Traffic, raw bytes) summed over every exchange recorded so far."""
        with self._lock:
            t = Traffic()
            t.merge(self._run[0])
            return t, self._run[1]

    def mark_written(self, step: int) -> None:
        """Steps up to ``step`` are not written (a checkpoint was loaded at it)."""
        self._written = max(self._written, step)

    def write(self, step: int, memory, compressing) -> None:
        """Write ``step``'s scalars, once: its bytes and ratio, each memory slot's norm, what
        the method logged; ``compressing``: whether the step was compressed (None: the
        method never compresses)."""
        if self.writer is None or step < 0 or step <= self._written:
            return
        self._written = step
        w, (t, raw) = self.writer, self.record(step)
        w.add_scalar("gradcomp/compression_ratio", raw / t.sent if t.sent else 0.0, step)
        w.add_scalar("gradcomp/wire_bytes", t.wire, step)
        w.add_scalar("gradcomp/sent_bytes", t.sent, step)
        if compressing is not None:  # the warm-up's schedule: 1 from the switch on
            w.add_scalar("gradcomp/compressing", 1.0 if compressing else 0.0, step)
        for slot in memory.slots():
            w.add_scalar(f"gradcomp/{slot}_norm", float(memory.norm(slot)), step)
        with self._lock:
            logs = self._logs.pop(step, {})
            for old in [k for k in self._logs if k < step]:
                del self._logs[old]
        for key, (total, n) in logs.items():
            w.add_scalar(f"gradcomp/{key}", float(total) / max(float(n), 1e-300), step)

    def close(self, last: int, memory, compressing) -> None:
        """Write the steps finished up to ``last`` not yet written, and flush the writer."""
        if self.writer is None:
            return
        for step in range(self._written + 1, last + 1):
            self.write(step, memory, compressing(step))
        if hasattr(self.writer, "flush"):
            self.writer.flush()
