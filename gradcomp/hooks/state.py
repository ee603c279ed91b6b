"""The hook state: one method's config and compressor, its per-parameter memory, the step
counter, the byte counters, and the communication thread that runs the exchanges.

Why threads: a bucket's exchange may need several dependent collectives (PowerSGD's two
allreduces, 1-bit's all-to-all then allgather). Issuing the second one from a future's
callback would let ranks interleave different buckets' collectives in different orders.
Here every exchange runs start to finish on a *lane*: a thread with a process group of its
own. Bucket b always goes to lane b % lanes, so every rank issues the same collectives in
the same order on each group, a bucket's consecutive steps run in order (its memory carries
from one to the next), and different buckets' exchanges run side by side: on a link with
latency a step pays about one bucket's round trips, not the sum over buckets. The hook
itself returns a future at once: backward never waits on the network.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import queue
import threading
import time
import weakref
import zlib
from typing import Sequence

import torch

from ..comm import Comm, Traffic
from ..compressors import METHODS
from ..compressors.base import ParamSlice
from ..config import MethodConfig
from ..memory import ParamMemory

_MIX = 0x9E3779B97F4A7C15
_LIVE: "weakref.WeakSet[GradcompState]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for state in list(_LIVE):
        state.close()


def _mix(*parts: int) -> int:
    h = 0
    for p in parts:
        h = ((h ^ (p & 0xFFFFFFFFFFFFFFFF)) * _MIX + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    return h >> 1


class _Ctx:
    """BucketContext for one bucket at one step (see compressors.base.BucketContext)."""

    def __init__(self, state: "GradcompState", comm: Comm, bucket: int, params: list[ParamSlice],
                 param_tensors, device, step: int):
        self.state, self.bucket, self.params = state, bucket, params
        self.comm, self.step = comm, step
        self.logging = state._writer is not None
        self.details = self.logging and state._details
        self._tensors, self._device = param_tensors, device

    def memory(self, slot):
        return self.state.memory.flat(slot, self.bucket, [p.name for p in self.params],
                                      [p.numel for p in self.params], self._device)

    def tensor(self, slot, name, init):
        return self.state.memory.tensor(slot, name, init)

    def segment_ids(self):
        return torch.repeat_interleave(
            torch.arange(len(self.params), device=self._device),
            torch.tensor([p.numel for p in self.params], device=self._device))

    def param_values(self):
        if self._tensors is None:
            raise RuntimeError("this bucket was reduced without its parameters")
        return torch.cat([t.detach().reshape(-1).float() for t in self._tensors])

    def seed(self, stream, name):
        return _mix(self.state.config.seed, self.step, zlib.crc32(name.encode()), self.comm.rank,
                    stream)

    def log(self, key, value):
        if not self.logging:
            return
        with self.state._lock:
            logs = self.state._logs.setdefault(self.step, {})
            total, n = logs.get(key, (0.0, 0))
            logs[key] = (total + value, n + 1)


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


def _slices(named) -> list[ParamSlice]:
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
        slices = _slices(corrections.items())
        fut = torch.futures.Future()
        fut.set_result(torch.cat([c.reshape(-1) for c in corrections.values()])
                       if corrections else torch.zeros(0))
        return cls(step, slices, fut)


class _Lane:
    """A communication thread and the process group it alone uses; its jobs run in order."""

    def __init__(self, state: "GradcompState", group):
        self.state, self.comm = state, Comm(group)
        self.queue: queue.Queue | None = None
        self.thread: threading.Thread | None = None

    def put(self, job) -> None:
        if self.thread is None:
            self.queue = queue.Queue()
            self.thread = threading.Thread(target=self.state._worker, args=(self,),
                                           name="gradcomp-comm", daemon=True)
            self.thread.start()
            _LIVE.add(self.state)
        self.queue.put(job)

    def close(self) -> None:
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join(timeout=30)
            self.thread = None
        self.comm.group = None


class GradcompState:
    """Everything one registered hook owns. Build it with :func:`gradcomp.register`, or
    directly to call ``register_comm_hook(state, gradcomp.hook)`` yourself."""

    def __init__(self, method: str, config: MethodConfig | None = None, *, group=None,
                 lane_groups: Sequence = (), param_names: dict[int, str] | None = None,
                 param_numels: dict[str, int] | None = None):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}: allowed {', '.join(sorted(METHODS))}")
        spec = METHODS[method]
        config = config if config is not None else spec.config()
        if not isinstance(config, spec.config):
            raise TypeError(f"method {method!r} takes a {spec.config.__name__}, "
                            f"got {type(config).__name__}")
        self.method, self.config = method, config
        self.compressor = spec.compressor(config)
        self.memory = ParamMemory()
        self.group = group
        self._lane_groups = list(lane_groups)  # more process groups: more buckets in flight
        self._param_names = param_names or {}
        self._param_numels = param_numels or {}
        self._step = -1                 # index of the step in flight
        self._records: dict[int, list] = {}  # step -> [Traffic, raw bytes], summed over buckets
        self._layouts: dict[int, tuple] = {}
        self.trace: list | None = None  # set to [] to record (event, bucket, start, end) times
        self._writer = None
        self._details = False
        self._logs: dict = {}  # step -> key -> (sum, count) of what methods logged
        self._written = -1     # the last step whose scalars went to the writer
        self._pending: list[_Pending] = []   # delayed exchanges, oldest first
        self._skipped: int | None = None     # index of a step whose gradients were not finite
        self.scaler = None  # a torch.amp.GradScaler whose scale the gradients carry
        self._params: dict[str, torch.Tensor] = {}
        self._setup_runtime()

    # ------------------------------------------------------------------ runtime
    def _setup_runtime(self):
        self._lanes = [_Lane(self, g) for g in [self.group, *self._lane_groups]]
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def __getstate__(self):
        d = self.__dict__.copy()
        self.drain()
        for k in ("group", "_lane_groups", "_lanes", "_lock", "_error", "_param_names",
                  "_params", "_writer", "scaler"):
            d.pop(k, None)
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self.group, self._param_names, self._params, self._writer = None, {}, {}, None
        self._lane_groups, self.scaler = [], None
        self._setup_runtime()

    @property
    def world_size(self) -> int:
        return self._lanes[0].comm.world_size

    def add_lanes(self, groups: Sequence) -> None:
        """More process groups, one lane each (before the first exchange)."""
        self._lane_groups += list(groups)
        self._lanes += [_Lane(self, g) for g in groups]

    @property
    def lanes(self) -> int:
        """How many buckets' exchanges can run at once (one process group each)."""
        return len(self._lanes)

    @property
    def step(self) -> int:
        """Optimizer steps whose communication has started."""
        return self._step + 1

    def digest(self) -> str:
        blob = json.dumps({"method": self.method, "config": self.config.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ the work
    def _begin(self, bucket: int) -> int:
        """Book-keeping on the caller's thread: the step counter. A step whose gradients held
        inf/NaN on some rank is not an optimizer step (a GradScaler skips it): without delay,
        the next step reuses its index, so schedules and random streams go on as if it
        never happened."""
        if bucket == 0:
            if self._skipped is not None and self._skipped == self._step and not self.config.delay:
                self._skipped = None
                with self._lock:
                    self._records.pop(self._step, None)
                    self._logs.pop(self._step, None)
            else:
                self._step += 1
        return max(self._step, 0)

    def reduce(self, x: torch.Tensor, params: Sequence[ParamSlice], bucket: int = 0,
               param_tensors=None) -> torch.Tensor:
        """Synchronously reduce one flat bucket (any float dtype); returns the average in
        x's dtype. The DDP hook runs exactly this, on the communication thread."""
        step = self._begin(bucket)
        return self._reduce(self._lanes[0].comm, x, list(params), bucket, param_tensors, step)

    def _reduce(self, comm, buf, params, bucket, param_tensors, step, scale=None):
        if bucket == 0 and self._writer is not None:
            # the last step every exchange of which has finished by now
            self._write_scalars(step - 1 - self.config.delay)
        traffic = comm.traffic = Traffic()
        x = buf if buf.dtype == torch.float32 else buf.float()
        if scale is not None:  # memory holds unscaled values: the loss scale may change
            x = x / scale
        t0 = time.perf_counter()
        ctx = _Ctx(self, comm, bucket, params, param_tensors, buf.device, step)
        if step < self.config.dense_steps:  # warm-up: uncompressed, memory untouched
            out = self.compressor.dense(x, ctx)
        elif self.compressor.stateless:
            out = self.compressor.reduce(x, ctx)
        else:
            slot = self.compressor.residual_slot if ctx.details and self.config.error_feedback else None
            if slot:
                names = [p.name for p in params]
                owed = _sq_norm(x, params, self.memory.peek(slot, names))
            out = self._guarded(x, ctx)
            if slot and self._skipped != step:
                kept = _sq_norm(None, params, self.memory.peek(slot, names))
                self._log_ratio(step, "residual_energy", kept, owed)
        if scale is not None:
            out = out * scale
        if out is not buf:
            buf.copy_(out)
        traffic.total_s += time.perf_counter() - t0
        with self._lock:
            rec = self._records.setdefault(step, [Traffic(), 0])
            rec[0].merge(traffic)
            rec[1] += buf.numel() * buf.element_size()
            for old in [k for k in self._records if k < step - self.config.delay - 4]:
                del self._records[old]
        return buf

    def _guarded(self, x, ctx):
        """Reduce with inf/NaN protection. Whether any rank's bucket holds a non-finite value
        travels beside the exchange; if one does, the step is garbage (a GradScaler skips
        it): the memory of the bucket's parameters is put back as it was, not poisoned for
        the rest of training, and the result is an allreduce of the non-finite ranks'
        gradients (the others add zeros), so every rank gets inf/NaN at exactly the
        positions a plain allreduce would give them."""
        finite = bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())  # 1 pass
        any_bad = ctx.comm.any_async(not finite, x.device)
        names = [p.name for p in ctx.params]
        snap = self.memory.snapshot(names, ctx.bucket)
        orig = None
        if not finite:  # the compressor must still run (same collectives on every rank)
            orig = x.clone()
            x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        out = self.compressor.reduce(x, ctx)
        if not any_bad():
            return out
        self.memory.restore(snap, names)
        self._skipped = ctx.step
        return ctx.comm.allreduce(orig if orig is not None else torch.zeros_like(x)).div_(self.world_size)

    # ------------------------------------------------------------------ DDP side
    def submit(self, bucket: int, buf: torch.Tensor, params) -> torch.futures.Future:
        """Queue one bucket's exchange; the returned future completes with the average."""
        names = []
        for p in params:
            name = self._param_names.get(id(p))
            if name is None:
                raise RuntimeError("a bucket holds a parameter the state does not know; "
                                   "register the state on the model it was built for")
            names.append(name)
        slices = _slices(zip(names, params))
        step = self._begin(bucket)
        scale = self._scale()
        event = None
        if buf.is_cuda:
            event = torch.cuda.Event()
            event.record()
        lane = self._lanes[bucket % len(self._lanes)]
        D = self.config.delay
        layout = tuple(names)
        if D and self._layouts.get(bucket) != layout and len(self._lanes) > 1:
            # DDP moved parameters between buckets (its rebuild): a parameter's previous
            # exchange may sit on another lane and must finish before its next one starts
            # (without delay every exchange of the previous step has finished already)
            self.drain()
        self._layouts[bucket] = layout
        if self.trace is not None:
            now = time.perf_counter()
            self.trace.append(("submit", bucket, now, now))
        if D == 0:
            fut = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
            lane.put((bucket, buf, slices, list(params), step, scale, event, fut, False))
            return fut
        # Delayed averaging: exchange a copy in the background, apply the local gradient now
        # plus the correction (average - local) of step - D.
        for name, p in zip(names, params):
            self._params[name] = p
        job = torch.futures.Future()
        lane.put((bucket, buf.clone(), slices, list(params), step, None, event, job, True))
        self._pending.append(_Pending(step, slices, job))
        corr = self._take(step - D, slices, buf)
        if corr is not None:
            buf.add_(corr)
        fut = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
        fut.set_result(buf)
        return fut

    def _scale(self):
        """The loss scale the current gradients carry (a copy: the scaler updates it in place
        after the step), or None without an enabled GradScaler."""
        s = self.scaler
        if s is None or not s.is_enabled() or getattr(s, "_scale", None) is None:
            return None
        return s._scale.detach().clone()

    def _take(self, step: int, slices, like: torch.Tensor):
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

    def drain(self) -> None:
        """Wait until every queued exchange has finished."""
        for e in self._pending:
            e.wait()

    def flush(self) -> dict:
        """End of training with ``delay``: wait for the exchanges still in flight and put the
        sum of their corrections into each parameter's ``.grad``; call ``optimizer.step()``
        once more after it and every averaged gradient has been applied. Returns the
        corrections by parameter name. A no-op without delay."""
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

    def close(self) -> None:
        """Stop the communication threads (after the exchanges queued so far). Called at
        interpreter exit for every state, so no thread still holds a process group while
        it is destroyed. An attached writer gets the scalars of the steps finished since
        the last write (they otherwise go out with the next step's first exchange) and is
        flushed."""
        for lane in self._lanes:
            lane.close()
        self.group = None
        if self._writer is not None:
            for step in range(self._written + 1, self._step + 1):
                self._write_scalars(step)
            if hasattr(self._writer, "flush"):
                self._writer.flush()

    def _worker(self, lane: _Lane):
        while True:
            job = lane.queue.get()
            if job is None:
                return
            bucket, buf, slices, params, step, scale, event, fut, delayed = job
            if self._error is not None:
                fut.set_exception(RuntimeError(f"gradcomp: an earlier exchange failed: {self._error}"))
                continue
            try:
                if event is not None:
                    torch.cuda.current_stream(buf.device).wait_event(event)
                local = buf.clone() if delayed else None
                t0 = time.perf_counter()
                with torch.profiler.record_function(f"gradcomp.{self.method}.bucket{bucket}"):
                    out = self._reduce(lane.comm, buf, slices, bucket, params, step, scale)
                if self.trace is not None:
                    self.trace.append(("exchange", bucket, t0, time.perf_counter()))
                fut.set_result(out.sub_(local) if delayed else out)
            except BaseException as exc:  # noqa: BLE001  (handed to DDP, which re-raises)
                self._error = exc
                fut.set_exception(exc)

    # ------------------------------------------------------------------ reporting
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
        link for those two), their ``ratio``, the number of ``collectives``, and the seconds
        spent inside collectives (``comm_s``) and compressing/decompressing (``codec_s``),
        summed over the step's buckets. With ``delay=D`` the latest step whose exchanges
        have all finished is D steps back."""
        t, raw = self._record(self._step - self.config.delay)
        W = self.world_size
        raw_wire = raw * 2 * (W - 1) / W
        return {
            "step": self.step, "raw_bytes": raw, "sent_bytes": t.sent,
            "wire_bytes": t.wire, "raw_wire_bytes": raw_wire,
            "ratio": raw / t.sent if t.sent else float("inf"),
            "collectives": t.collectives,
            "comm_s": t.comm_s, "codec_s": t.total_s - t.comm_s,
        }

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything needed to resume exactly: memory by parameter name, the step counter and
        the delayed exchanges still to be applied (waited for first)."""
        pending = [{"step": e.step, "corrections": {n: c.clone() for n, c in e.owed()}}
                   for e in self._pending]
        return {"method": self.method, "config": self.config.to_dict(), "world_size": self.world_size,
                "step": self.step, "memory": self.memory.state_dict(), "pending": pending}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("method") != self.method or sd.get("config") != self.config.to_dict():
            raise ValueError(f"checkpoint is for method {sd.get('method')!r} with {sd.get('config')}; "
                             f"this state runs {self.method!r} with {self.config.to_dict()}")
        if sd.get("world_size") != self.world_size:
            raise ValueError(f"checkpoint was saved with world size {sd.get('world_size')}; "
                             f"this job has {self.world_size}: residuals do not transfer")
        known = set(self._param_names.values())
        unknown = self.memory_names(sd) - known if known else set()
        if unknown:
            raise ValueError(f"checkpoint holds state for parameters this model lacks: "
                             f"{', '.join(sorted(unknown)[:5])}")
        for slot, d in sd["memory"]["flat"].items():
            for name, v in d.items():
                want = self._param_numels.get(name)
                if want is not None and v.numel() != want:
                    raise ValueError(f"checkpoint slot {slot!r} holds {v.numel()} elements for "
                                     f"parameter {name!r}; this model's has {want}")
        self.memory.load_state_dict(sd["memory"])
        self._step = sd["step"] - 1
        self._written = max(self._written, self._step)
        self._pending = [_Pending.done(p["step"], p["corrections"]) for p in sd.get("pending", [])]

    @staticmethod
    def memory_names(sd: dict) -> set:
        return {n for part in sd["memory"].values() for d in part.values() for n in d}
