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
        logged nothing). See ``Session.attach``."""
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


def state_stats(state) -> dict:
    """What the state has done, counted in optimizer steps (calls of ``optimizer.step()``)
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


def attach_writer(state, writer, details: bool = False) -> None:
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
    state.telemetry.attach(writer, details, state.step - 1)
