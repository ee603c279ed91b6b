"""Checkpoints: ``state_dict()`` holds everything a bit-exact resume needs (memory by
parameter name, the step counter, exchanges still owed); ``load_state_dict()`` refuses a
checkpoint of another method, options, world size or model with a message naming it."""
from __future__ import annotations

import hashlib
import json

from .delayed import _Pending
from .topology import base_name


class Checkpoint:
    """Mixin of GradcompState."""

    def digest(self) -> str:
        blob = json.dumps({"method": self.method, "config": self.config.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: memory by parameter name, the step counter,
        the delayed exchanges still to be applied (waited for first) and, with local_steps,
        the rounds' state (hooks/local.py) and the adaptive warm-up's (hooks/warmup.py)."""
        pending = [{"step": e.step, "corrections": {n: c.clone() for n, c in e.owed()}}
                   for e in self._pending]
        return {"method": self.method, "config": self.config.to_dict(), "world_size": self.world_size,
                "ranks_per_node": self.local_size,
                "step": self.step, "memory": self.memory.state_dict(), "pending": pending,
                "local": self.local_state_dict(), "warmup": self.warmup_state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        # options added since a checkpoint was written take their defaults; the topology is
        # compared as resolved (ranks per node), below, and the warm-up as the rule that runs
        # (a checkpoint's "adaptive" is today's "auto" at local_steps=1)
        saved = {**type(self.config)().to_dict(), **sd.get("config", {})}
        mine = self.config.to_dict()
        for k in ("topology", "local_size"):
            saved.pop(k), mine.pop(k)
        if saved["warmup"] == "auto":
            saved["warmup"] = "none" if saved["local_steps"] > 1 else "adaptive"
        mine["warmup"] = self.config.warmup_rule
        if sd.get("method") != self.method or saved != mine:
            raise ValueError(f"checkpoint is for method {sd.get('method')!r} with {sd.get('config')}; "
                             f"this state runs {self.method!r} with {self.config.to_dict()}")
        if sd.get("world_size") != self.world_size:
            raise ValueError(f"checkpoint was saved with world size {sd.get('world_size')}; "
                             f"this job has {self.world_size}: residuals do not transfer")
        saved_local = sd.get("ranks_per_node", 0)
        if saved_local != self.local_size:
            def topo(n):
                return f"hierarchical with {n} ranks per node" if n else "flat"
            raise ValueError(f"checkpoint was saved with topology {topo(saved_local)}; this job "
                             f"runs {topo(self.local_size)}: its memory is kept per shard of "
                             f"that topology; set topology=/local_size= as when it was saved")
        known = set(self._param_names.values())
        unknown = self.memory_names(sd) - known if known else set()
        if unknown:
            raise ValueError(f"checkpoint holds state for parameters this model lacks: "
                             f"{', '.join(sorted(unknown)[:5])}")
        for slot, d in sd["memory"]["flat"].items():
            scalar = slot in self.compressor.scalar_slots  # one value per parameter
            for name, v in d.items():
                want = self._param_numels.get(name)  # (a shard's piece: checked above)
                want = 1 if scalar and want is not None else want
                if want is not None and v.numel() != want:
                    raise ValueError(f"checkpoint slot {slot!r} holds {v.numel()} elements for "
                                     f"parameter {name!r}; this model's has {want}")
        self.memory.load_state_dict(sd["memory"])
        self._step = sd["step"] - 1
        self._written = max(self._written, self._step)
        self._pending = [_Pending.done(p["step"], p["corrections"]) for p in sd.get("pending", [])]
        self.load_local_state_dict(sd.get("local"))
        self.load_warmup_state_dict(sd.get("warmup"))

    @staticmethod
    def memory_names(sd: dict) -> set:
        return {base_name(n) for part in sd["memory"].values() for d in part.values() for n in d}
