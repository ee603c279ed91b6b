"""Telemetry: per-step byte and time counters (``stats()``) and TensorBoard scalars."""
from __future__ import annotations

import torch

from ..comm import Traffic


def _sq_norm(x, params, views) -> torch.Tensor:
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
    """Mixin of GradcompState: what a step cost and what the method logged."""

    def attach(self, writer, details: bool = False) -> None:
        """Log per-step scalars to a TensorBoard ``SummaryWriter`` (or anything with
        ``add_scalar``): compression ratio, wire and sent bytes, the norm of each memory slot
        (residuals, velocities) and what the method records (DGC's sparsity and mean sampled
        threshold; with ``details`` also PowerSGD's relative approximation error and, for a
        method whose residual is its own message's error (``Compressor.residual_slot``:
        onebit's first stage, terngrad, topk, threshold), ``residual_energy``: ||residual after the
        step||^2 / ||gradient + residual before||^2, summed over the step's buckets, i.e.
        1 - delta of error feedback's contraction (at or above 1 the residual does not
        shrink); both cost passes over the gradient). Written from the communication thread when a step's
        exchanges have all finished; nothing is computed while no writer is attached."""
        self._writer, self._details = writer, details
        self._written = max(self._written, self._step - 1)  # earlier steps logged nothing

    def _log_ratio(self, step: int, key: str, num, den) -> None:
        """Record num / den for ``step``, both summed over the step's buckets first (so a
        large bucket weighs by its size, not as one of many)."""
        with self._lock:
            logs = self._logs.setdefault(step, {})
            a, b = logs.get(key, (0.0, 0.0))
            logs[key] = (a + num, b + den)

    def _record(self, step: int):
        with self._lock:
            return self._records.get(step) or [Traffic(), 0]

    def _write_scalars(self, step: int) -> None:
        if step < 0 or step <= self._written:
            return
        self._written = step
        w, (t, raw) = self._writer, self._record(step)
        w.add_scalar("gradcomp/compression_ratio", raw / t.sent if t.sent else 0.0, step)
        w.add_scalar("gradcomp/wire_bytes", t.wire, step)
        w.add_scalar("gradcomp/sent_bytes", t.sent, step)
        if not self.compressor.stateless:  # the warm-up's schedule: 1 from the switch on
            w.add_scalar("gradcomp/compressing", 0.0 if self._dense(step) else 1.0, step)
        for slot in self.memory.slots():
            w.add_scalar(f"gradcomp/{slot}_norm", float(self.memory.norm(slot)), step)
        with self._lock:
            logs = self._logs.pop(step, {})
            for old in [k for k in self._logs if k < step]:
                del self._logs[old]
        for key, (total, n) in logs.items():
            w.add_scalar(f"gradcomp/{key}", float(total) / max(float(n), 1e-300), step)

    def stats(self) -> dict:
        """Bytes of the latest step: ``raw_bytes`` (the gradients' own size, what a plain
        allreduce hands over), ``sent_bytes`` (the messages this rank handed to collectives),
        ``wire_bytes`` / ``raw_wire_bytes`` (what ring-style collectives put on this rank's
        link for those two; ``intra_node_wire_bytes`` the part that stayed inside a node
        under a hierarchical topology, ``inter_node_wire_bytes`` the rest, which crossed
        between nodes (under a flat topology all of it may), their ``ratio``, the number of
        ``collectives``, and the seconds
        spent inside collectives (``comm_s``) and compressing/decompressing (``codec_s``),
        summed over the step's buckets. With ``delay=D`` the latest step whose exchanges
        have all finished is D steps back. The warm-up's schedule: ``compressing`` (whether
        the step in flight is compressed; False for plain allreduce), ``warmup_switch_step``
        (the first compressed step; None while the adaptive rule has not decided) and
        ``warmup_ratio`` (the adaptive rule's last window ratio r, None before two windows).
        ``topology``: "flat" or "hierarchical"; ``topology_probe``: what ``topology=auto``
        measured on several nodes (seconds per exchange of one bucket each way, the slowest
        rank's, and the choice), None where it did not run."""
        t, raw = self._record(self._step - self.config.delay)
        W = self.world_size
        raw_wire = raw * 2 * (W - 1) / W
        return {
            "step": self.step, "raw_bytes": raw, "sent_bytes": t.sent,
            "wire_bytes": t.wire, "raw_wire_bytes": raw_wire,
            "intra_node_wire_bytes": t.intra, "inter_node_wire_bytes": t.wire - t.intra,
            "ratio": raw / t.sent if t.sent else float("inf"),
            "collectives": t.collectives,
            "comm_s": t.comm_s, "codec_s": t.total_s - t.comm_s,
            "compressing": not self.compressor.stateless and not self._dense(max(self._step, 0)),
            "warmup_switch_step": self._switch_step(), "warmup_ratio": self._wu_ratio,
            "topology": "hierarchical" if self.local_size else "flat",
            "topology_probe": self.topology_probe,
        }
