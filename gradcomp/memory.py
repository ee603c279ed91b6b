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
        # CPU buffers of bucket size kept per (slot, bucket) for reuse: snapshot copies given
        # back by release() and buffers swapped out by commit(). A copy into one is a pass
        # over warm memory (a fresh clone of a bucket-sized buffer pays a page fault per
        # 4 KB on its first write: 26 against 9 ms for 11M elements)
        self._spares: dict[tuple[str, int], list[torch.Tensor]] = {}
        # per-parameter slots no exchange writes (the Adam binding's, written by the
        # optimizer's step): a snapshot neither copies nor restores them
        self.unguarded: set[str] = set()

    def __getstate__(self):
        d = self.__dict__.copy()
        d.pop("_lock")
        d["_spares"] = {}
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self.__dict__.setdefault("_spares", {})
        self.__dict__.setdefault("unguarded", set())
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

    def find(self, slot: str, name: str) -> torch.Tensor | None:
        """The per-parameter tensor of ``slot`` for ``name``, None where there is none."""
        with self._lock:
            return self._tensors.get(slot, {}).get(name)

    def put(self, slot: str, name: str, t: torch.Tensor) -> None:
        """Replace the per-parameter tensor of ``slot`` for ``name``."""
        with self._lock:
            self._tensors.setdefault(slot, {})[name] = t

    def tensor(self, slot: str, name: str, init: Callable[[], torch.Tensor]) -> torch.Tensor:
        with self._lock:
            d = self._tensors.setdefault(slot, {})
            t = d.get(name)
            if t is None:
                t = d[name] = init()
            return t

    def snapshot(self, names, bucket=None, slots=None) -> dict:
        """Copies of the memory of the parameters ``names`` (see :meth:`restore`): their
        per-parameter tensors, and the flat ``slots`` (None: every slot; more can be added
        with :meth:`cover` before they change). Where a slot's flat buffer for ``bucket``
        holds exactly ``names``, it is copied whole (one copy per slot instead of one per
        parameter: on a GPU each is a launch)."""
        layout, names = tuple(names), set(names)
        with self._lock:
            keys = [(s, n) for s, d in self._tensors.items() if s not in self.unguarded
                    for n in d if n in names]
            # one multi-tensor copy for all of them (x * 1 is x, bit for bit)
            copies = torch._foreach_mul([self._tensors[s][n] for s, n in keys], 1.0) if keys else []
            snap = {"bucket": bucket, "layout": layout, "covered": set(),
                    "existing": set(self._views), "whole": {}, "flat": {},
                    "tensors": dict(zip(keys, copies))}
            for s in list(self._views) if slots is None else slots:
                self._cover(snap, s)
            return snap

    def cover(self, snap: dict, slot: str) -> None:
        """Add ``slot`` to ``snap`` (a copy of it now) unless it is there: called before the
        slot is first written (the guard's snapshots are taken slot by slot, as the exchange
        asks for them: a slot the exchange only replaces (:meth:`next_flat`) or never touches
        is not copied)."""
        with self._lock:
            if slot not in snap["covered"]:
                self._cover(snap, slot)

    def _cover(self, snap, s):
        snap["covered"].add(s)
        bucket, layout = snap["bucket"], snap["layout"]
        buf = self._whole(s, bucket, layout)
        if buf is not None:
            snap["whole"][s] = (buf, self._copy(s, bucket, buf))
        else:
            names = set(layout)
            snap["flat"].update({(s, n): v.clone() for n, v in self._views.get(s, {}).items()
                                 if n in names})

    def next_flat(self, slot: str, bucket: int, names: Sequence[str], numels: Sequence[int],
                  device) -> tuple[torch.Tensor, torch.Tensor]:
        """(current, next): the flat buffer of ``slot`` (as :meth:`flat`) and a buffer laid
        out like it, uninitialized, that becomes the slot's buffer at :meth:`commit` (or goes
        back to the spares at :meth:`discard`). For an exchange that rewrites every element
        of a slot: no snapshot of it is needed (the current buffer is not written), and no
        copy after (on the CPU the previous buffer is the next one: two buffers swap)."""
        with self._lock:
            cur = self._flat_locked(slot, bucket, names, numels, device)
            return cur, self._spare(slot, bucket, cur)

    def commit(self, slot: str, bucket: int, nxt: torch.Tensor) -> None:
        """``nxt`` (from :meth:`next_flat`, written whole) is the slot's buffer from now on;
        the previous one becomes the spare."""
        with self._lock:
            layout, cur = self._flat[(slot, bucket)]
            if nxt.shape != cur.shape or nxt.device != cur.device:
                raise RuntimeError(f"memory slot {slot!r}: the buffer to commit does not match "
                                   f"the slot's ({tuple(nxt.shape)} against {tuple(cur.shape)})")
            views = self._views[slot]
            self._flat[(slot, bucket)] = (layout, nxt)
            views.update(zip(layout, nxt.split([views[n].numel() for n in layout])))
            self._keep(slot, bucket, cur)

    def revert(self, slot: str, bucket: int, before: torch.Tensor) -> None:
        """Undo :meth:`commit`: ``before`` (the slot's buffer until then, kept as the spare
        and not written since) is the slot's buffer again."""
        with self._lock:
            spares = self._spares.get((slot, bucket), [])
            spares[:] = [t for t in spares if t is not before]
            self.commit(slot, bucket, before)

    def discard(self, slot: str, bucket: int, nxt: torch.Tensor) -> None:
        """``nxt`` (from :meth:`next_flat`) is not committed: back to the spares."""
        with self._lock:
            self._keep(slot, bucket, nxt)

    def _spare(self, slot, bucket, like):
        """A buffer shaped like ``like``: a spare of (slot, bucket) where one fits, else new."""
        spares = self._spares.get((slot, bucket))
        while spares:
            t = spares.pop()
            if t.shape == like.shape and t.dtype == like.dtype and t.device == like.device:
                return t
        return torch.empty_like(like)

    def _keep(self, slot, bucket, t):
        """Keep t as the spare of (slot, bucket) (one per pair: one exchange of a bucket at
        a time), on the CPU (a GPU's allocator caches its blocks itself)."""
        if t.device.type == "cpu":
            spares = self._spares.setdefault((slot, bucket), [])
            if not spares:
                spares.append(t)

    def _copy(self, slot, bucket, buf):
        """A copy of buf: into a spare of (slot, bucket) on the CPU where one fits."""
        return self._spare(slot, bucket, buf).copy_(buf)

    def release(self, snap: dict) -> None:
        """``snap`` is no longer needed (its exchange is over, restored or not): its whole
        copies of CPU buffers are kept for the next snapshot of their (slot, bucket)."""
        with self._lock:
            for s, (buf, copy) in snap["whole"].items():
                self._keep(s, snap["bucket"], copy)
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
        """Put the parameters ``names`` back as they were at ``snap``: the slots it covers
        from its copies, slots created since from zero (flat) and tensors from their
        initializer; slots it does not cover were not written (see :meth:`cover`)."""
        layout = tuple(names)
        names = set(names)
        with self._lock:
            for s, d in self._views.items():
                if s not in snap["covered"]:
                    if s not in snap["existing"]:  # created since: from zero
                        for n in layout:
                            if d.get(n) is not None:
                                d[n].zero_()
                    continue
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
                if s in self.unguarded:
                    continue
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
