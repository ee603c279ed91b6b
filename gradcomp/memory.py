"""Per-parameter fp32 memory (error-feedback residuals, velocities, low-rank factors).

Compressors work on a bucket's flat buffer, so memory is stored flat per bucket layout:
one contiguous fp32 tensor per (slot, bucket), with each parameter's entry a view into it.
State is *addressed* by parameter name, never by bucket index: when DDP rebuilds its
buckets after the first iteration (or a layout changes for any reason) each parameter's
values are copied into the new layout, so nothing resets silently. ``state_dict`` is keyed
by parameter name and is valid whatever the bucket layout of the process that loads it.
Buckets' exchanges run on several threads at once (disjoint parameters): changes to the
dictionaries, and walks over them, hold a lock.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch


class ParamMemory:
    def __init__(self):
        self._views: dict[str, dict[str, torch.Tensor]] = {}       # slot -> name -> flat view
        self._flat: dict[tuple[str, int], tuple[tuple, torch.Tensor]] = {}  # (slot, bucket)
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}     # slot -> name -> tensor
        self._lock = threading.RLock()
        # CPU snapshot copies given back by release(), per (slot, bucket): reused, a copy
        # into them is one pass over warm memory (a fresh clone of a bucket-sized buffer pays
        # a page fault per 4 KB on its first write: 26 against 9 ms for 11M elements)
        self._spares: dict[tuple[str, int], list[torch.Tensor]] = {}

    def __getstate__(self):
        d = self.__dict__.copy()
        d.pop("_lock")
        d["_spares"] = {}
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self.__dict__.setdefault("_spares", {})
        self._lock = threading.RLock()

    def flat(self, slot: str, bucket: int, names: Sequence[str], numels: Sequence[int],
             device) -> torch.Tensor:
        """The flat fp32 buffer of ``slot`` for a bucket holding ``names`` in this order."""
        with self._lock:
            return self._flat_locked(slot, bucket, names, numels, device)

    def _flat_locked(self, slot, bucket, names, numels, device):
        layout = tuple(names)
        hit = self._flat.get((slot, bucket))
        if hit is not None and hit[0] == layout and hit[1].device == torch.device(device):
            return hit[1]
        buf = torch.zeros(sum(numels), dtype=torch.float32, device=device)
        views = self._views.setdefault(slot, {})
        off = 0
        for name, n in zip(names, numels):
            view = buf[off : off + n]
            old = views.get(name)
            if old is not None:
                if old.numel() != n:
                    raise ValueError(f"memory slot {slot!r} holds {old.numel()} elements for "
                                     f"parameter {name!r}, which has {n}")
                view.copy_(old.reshape(-1))
            views[name] = view
            off += n
        self._flat[(slot, bucket)] = (layout, buf)
        return buf

    def peek(self, slot: str, names: Sequence[str]) -> list[torch.Tensor | None]:
        """Each parameter's current view of ``slot``, None where it has none: reads, never
        creates (diagnostics must not add state)."""
        with self._lock:
            views = self._views.get(slot, {})
            return [views.get(n) for n in names]

    def tensor(self, slot: str, name: str, init: Callable[[], torch.Tensor]) -> torch.Tensor:
        with self._lock:
            d = self._tensors.setdefault(slot, {})
            t = d.get(name)
            if t is None:
                t = d[name] = init()
            return t

    def snapshot(self, names, bucket=None) -> dict:
        """Copies of every slot of the parameters ``names`` (see :meth:`restore`). Where a
        slot's flat buffer for ``bucket`` holds exactly ``names``, it is copied whole (one
        copy per slot instead of one per parameter: on a GPU each is a launch)."""
        layout = tuple(names)
        names = set(names)
        with self._lock:
            whole, flat = {}, {}
            for s, d in self._views.items():
                buf = self._whole(s, bucket, layout)
                if buf is not None:
                    whole[s] = (buf, self._copy(s, bucket, buf))
                else:
                    flat.update({(s, n): v.clone() for n, v in d.items() if n in names})
            keys = [(s, n) for s, d in self._tensors.items() for n in d if n in names]
            # one multi-tensor copy for all of them (x * 1 is x, bit for bit)
            copies = torch._foreach_mul([self._tensors[s][n] for s, n in keys], 1.0) if keys else []
            return {"bucket": bucket, "whole": whole, "flat": flat,
                    "tensors": dict(zip(keys, copies))}

    def _copy(self, slot, bucket, buf):
        """A copy of buf: into a spare of (slot, bucket) on the CPU where one fits."""
        spares = self._spares.get((slot, bucket))
        while spares:
            t = spares.pop()
            if t.shape == buf.shape and t.dtype == buf.dtype and t.device == buf.device:
                return t.copy_(buf)
        return buf.clone()

    def release(self, snap: dict) -> None:
        """``snap`` is no longer needed (its exchange is over, restored or not): its whole
        copies of CPU buffers are kept for the next snapshot of their (slot, bucket)."""
        with self._lock:
            for s, (buf, copy) in snap["whole"].items():
                if copy.device.type == "cpu":
                    spares = self._spares.setdefault((s, snap["bucket"]), [])
                    if not spares:  # one exchange of a bucket at a time
                        spares.append(copy)
            snap["whole"] = {}

    def _whole(self, slot, bucket, layout):
        """The flat buffer of (slot, bucket) if every view of ``layout`` lies in it, in order."""
        hit = self._flat.get((slot, bucket))
        if hit is None or hit[0] != layout:
            return None
        views = self._views.get(slot, {})
        if all(views.get(n) is not None and views[n]._base is hit[1] for n in layout):
            return hit[1]
        return None

    def restore(self, snap: dict, names) -> None:
        """Put the parameters ``names`` back as they were at ``snap``: slots created since
        start again from zero (flat) or from their initializer (tensors)."""
        layout = tuple(names)
        names = set(names)
        with self._lock:
            for s, d in self._views.items():
                buf, old_whole = snap["whole"].get(s, (None, None))
                if buf is not None and buf is self._whole(s, snap["bucket"], layout):
                    buf.copy_(old_whole)
                    continue
                off = 0
                for n in layout:  # views in layout order: offsets into a whole copy
                    v = d.get(n)
                    if v is None:
                        continue
                    if old_whole is not None:
                        v.copy_(old_whole[off : off + v.numel()])
                    else:
                        old = snap["flat"].get((s, n))
                        v.copy_(old) if old is not None else v.zero_()
                    off += v.numel()
            dst, src = [], []
            for s, d in self._tensors.items():
                for n in [n for n in d if n in names]:
                    old = snap["tensors"].get((s, n))
                    if old is None:
                        del d[n]
                    else:
                        dst.append(d[n]), src.append(old)
            if dst:
                torch._foreach_copy_(dst, src)

    def state_dict(self) -> dict:
        with self._lock:
            return {
                "flat": {s: {n: v.clone() for n, v in d.items()} for s, d in self._views.items()},
                "tensors": {s: {n: t.clone() for n, t in d.items()}
                            for s, d in self._tensors.items()},
            }

    def load_state_dict(self, sd: dict) -> None:
        self._flat.clear()
        self._views = {s: {n: v.clone().reshape(-1).float() for n, v in d.items()}
                       for s, d in sd["flat"].items()}
        self._tensors = {s: {n: t.clone() for n, t in d.items()} for s, d in sd["tensors"].items()}

    def names(self) -> set[str]:
        out = set()
        for d in list(self._views.values()) + list(self._tensors.values()):
            out.update(d)
        return out

    def slots(self) -> list[str]:
        """Names of the flat memory slots in use (e.g. ``residual``, ``velocity``)."""
        with self._lock:
            return [s for s, d in self._views.items() if d]

    def norm(self, slot: str) -> torch.Tensor | None:
        with self._lock:
            views = list(self._views.get(slot, {}).values())
        if not views:
            return None
        return torch.stack([v.norm() for v in views]).norm()
