"""How many aten ops one bucket's exchange costs, per method (the codec issue's measure).

Every op ``gradcomp.State.reduce`` dispatches for one bucket at world size 1 is counted with
a TorchDispatchMode: all of them ("ops"), and those that do work ("kernel ops": on a GPU
each is at least one kernel launch; views, ``detach`` and ``lift_fresh`` only make a new
tensor header and are left out). ``launches`` counts what a GPU would launch: the exchange
runs the Triton kernels (``GRADCOMP_KERNELS=triton``; on a CPU under ``TRITON_INTERPRET=1``),
each Triton launch counts 1 and the aten ops around them count as kernel ops. The CPU path's
kernel ops also include its cache blocking (:mod:`gradcomp.kernels.cpu` runs each step over
blocks of 2^18 elements), which grows with the bucket's size, not its tensor count. Layouts: DDP's 25 MB
buckets of ResNet-18 and of GPT-2 small's parameter shapes, and 1M elements cut into 16 or
160 tensors (to check that the count does not grow with the tensor count). A warm
step runs first, so memory creation is not counted.

:func:`gpu_launches` counts what a GPU launches without one, on the GPU's own path: the
exchange runs on CPU tensors that say they are CUDA tensors (``Tensor.device`` and
``is_cuda`` answer cuda, so every choice the library makes by device takes its GPU branch;
the dispatch mode runs each op on the CPU), every Triton launch is counted and not run
(its outputs stay as allocated, zero-filled here, so indices stay in range), and each op
that does work counts one launch. What launches nothing on a GPU is left out: views, a new
header (``detach``, ``alias``), an allocation (``empty*``); a copy between host and device
(``kernels.host``) counts one. The collectives (:class:`gradcomp.comm.Comm`) are not
counted: the count is the codec's, besides its collectives. A read of a device value on the
host (``.item()``) is listed as ``"host read"``: on a GPU it would be a wait.
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from gradcomp.compressors.base import ParamSlice
from gradcomp.hooks import build_config
from gradcomp import State

SPECS = ("allreduce", "topk", "dgc", "onebit", "terngrad", "powersgd", "threshold")
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


_HEADER_ONLY = {"detach", "lift_fresh", "alias"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = self.kernels = 0
        self.inside = False  # in a Triton launch: the interpreter's own copies do not count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.n += 1
            if not func.is_view and func.overloadpacket.__name__ not in _HEADER_ONLY:
                self.kernels += 1
        return func(*args, **(kwargs or {}))


def gpt2_small_shapes() -> list[tuple[str, tuple]]:
    """GPT-2 small (124M): token and position embeddings, 12 blocks, final norm."""
    d, out = 768, [("wte", (50257, 768)), ("wpe", (1024, 768))]
    for i in range(12):
        out += [(f"h{i}.ln_1.w", (d,)), (f"h{i}.ln_1.b", (d,)),
                (f"h{i}.attn.c_attn.w", (d, 3 * d)), (f"h{i}.attn.c_attn.b", (3 * d,)),
                (f"h{i}.attn.c_proj.w", (d, d)), (f"h{i}.attn.c_proj.b", (d,)),
                (f"h{i}.ln_2.w", (d,)), (f"h{i}.ln_2.b", (d,)),
                (f"h{i}.mlp.c_fc.w", (d, 4 * d)), (f"h{i}.mlp.c_fc.b", (4 * d,)),
                (f"h{i}.mlp.c_proj.w", (4 * d, d)), (f"h{i}.mlp.c_proj.b", (d,))]
    return out + [("ln_f.w", (d,)), ("ln_f.b", (d,))]


def resnet18_shapes() -> list[tuple[str, tuple]]:
    from .models import build
    return [(n, tuple(p.shape)) for n, p in build("resnet18").named_parameters()]


def even_shapes(total: int, count: int) -> list[tuple[str, tuple]]:
    """``count`` matrices of 64 columns, about ``total`` elements together."""
    return [(f"p{i}", (total // count // 64, 64)) for i in range(count)]


def buckets(shapes, cap_bytes: int = BUCKET_BYTES) -> list[list[ParamSlice]]:
    """Parameters in reverse order (as DDP buckets them) cut into buckets of cap_bytes."""
    out, cur, off = [], [], 0
    for name, shape in reversed(shapes):
        n = math.prod(shape)
        if cur and (off + n) * 4 > cap_bytes:
            out.append(cur)
            cur, off = [], 0
        cur.append(ParamSlice(name, shape, off, n))
        off += n
    return out + ([cur] if cur else [])


@contextlib.contextmanager
def _triton_launches(mode):
    """Route the exchange through the Triton kernels and count their launches into mode.n
    and mode.kernels (each launch is one op that does work)."""
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit
    patched = []
    for cls in (jit.JITFunction, interp.InterpretedFunction):
        run = cls.run

        def counted(self, *args, _run=run, **kwargs):
            if mode.inside:  # a kernel launched from inside another (none here) counts once
                return _run(self, *args, **kwargs)
            mode.n += 1
            mode.kernels += 1
            mode.inside = True
            try:
                return _run(self, *args, **kwargs)
            finally:
                mode.inside = False
        cls.run = counted
        patched.append((cls, run))
    old = os.environ.get("GRADCOMP_KERNELS")
    os.environ["GRADCOMP_KERNELS"] = "triton"
    try:
        yield
    finally:
        for cls, run in patched:
            cls.run = run
        if old is None:
            os.environ.pop("GRADCOMP_KERNELS")
        else:
            os.environ["GRADCOMP_KERNELS"] = old


def count(spec: str, layout: list[ParamSlice], seed: int = 0, kernels: bool = False,
          launches: bool = False) -> int:
    """aten ops of one warm exchange of the bucket ``layout`` (world size 1); with
    ``kernels``, only those that do work (no views); with ``launches``, the GPU's launches
    (Triton kernels and the aten ops around them; needs Triton, and ``TRITON_INTERPRET=1``
    set before Triton is imported where there is no GPU)."""
    # the compressed exchange (the adaptive warm-up would make the first steps dense)
    name, cfg = build_config(spec, **({} if "warmup=" in spec else {"warmup": "none"}))
    state = State(name, cfg)
    n = sum(p.numel for p in layout)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    mode = _Count()
    with _triton_launches(mode) if launches else contextlib.nullcontext():
        state.reduce(x.clone(), layout)  # warm: memory created (and kernels compiled)
        mode.n = mode.kernels = 0
        with mode:
            state.reduce(x.clone(), layout)
    return mode.kernels if kernels or launches else mode.n


def run(specs=SPECS, launch: bool = True) -> list[dict]:
    """One row per (method, layout). ``launch``: also count the GPU launches (Triton must be
    importable; without a GPU, set ``TRITON_INTERPRET=1`` before importing it)."""
    layouts = {"16 tensors, 1M": [buckets(even_shapes(2**20, 16), 2**40)[0]],
               "160 tensors, 1M": [buckets(even_shapes(2**20, 160), 2**40)[0]],
               "resnet18": buckets(resnet18_shapes()),
               "gpt2-small": buckets(gpt2_small_shapes())}
    rows = []
    for spec in specs:
        for key, bs in layouts.items():
            ops = [count(spec, b) for b in bs]
            work = [count(spec, b, kernels=True) for b in bs]
            # the Triton interpreter is slow: GPT-2's 124M elements are left out
            gpu = ([count(spec, b, launches=True) for b in bs]
                   if launch and key != "gpt2-small" else None)
            rows.append({"method": spec, "layout": key, "buckets": len(bs),
                         "tensors": sum(len(b) for b in bs), "ops_per_step": sum(ops),
                         "max_ops_per_bucket": max(ops), "kernel_ops_per_step": sum(work),
                         "max_kernel_ops_per_bucket": max(work),
                         "max_launches_per_bucket": max(gpu) if gpu else None})
    return rows


# --------------------------------------------------------------------------- GPU launches
_CUDA, _CPU = torch.device("cuda", 0), torch.device("cpu")
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_NO_LAUNCH = _HEADER_ONLY | _ALLOCATIONS


def _on_cpu(d):
    if isinstance(d, str) and d.startswith("cuda"):
        return _CPU
    return _CPU if isinstance(d, torch.device) and d.type == "cuda" else d


class _Launches(TorchDispatchMode):
    """Runs every op on the CPU (a device of cuda becomes the CPU) and counts, while ``on``
    and outside a collective (``quiet``), the ops a GPU would launch."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.on = False
        self.quiet = 0

    def add(self, what: str) -> None:
        if self.on and not self.quiet:
            self.counts[what] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {k: _on_cpu(v) if k == "device" else v for k, v in (kwargs or {}).items()}
        args = tree_map(_on_cpu, args)
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.add("host read")
        elif not func.is_view and name not in _NO_LAUNCH:
            self.add(str(func))
        out = func(*args, **kwargs)
        if name in _ALLOCATIONS:
            out.zero_()  # the Triton kernels do not run: what they would write stays zero
        return out


@contextlib.contextmanager
def _posing_as_cuda(mode: _Launches):
    """CPU tensors that say they are on cuda:0; Triton launches, host copies and collectives
    counted into ``mode`` (the launches not run)."""
    import numpy
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    from gradcomp import comm
    from gradcomp.kernels import host

    saved = []

    def put(obj, name, new):
        saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, new)

    put(torch.Tensor, "device", property(lambda t: _CUDA))
    put(torch.Tensor, "is_cuda", property(lambda t: True))
    put(torch.cuda, "_lazy_init", lambda: None)  # a factory with device=cuda reaches the mode
    for fn in ("tensor", "as_tensor"):  # these build their tensor below the dispatch mode
        put(torch, fn, lambda *a, _f=getattr(torch, fn), **k: _f(
            *a, **{key: _on_cpu(v) if key == "device" else v for key, v in k.items()}))
    for cls in (jit.JITFunction, interp.InterpretedFunction):  # compiled or interpreted
        put(cls, "run", lambda self, *a, **k: mode.add(f"triton {self.fn.__name__}"))

    def to_device(values, dtype, device):
        mode.add("host to device copy")
        return torch.tensor(values, dtype=dtype)

    def to_host_later(t):
        mode.add("device to host copy")
        out = numpy.empty(tuple(t.shape), dtype=host._NUMPY[t.dtype])
        mode.quiet += 1
        try:
            torch.from_numpy(out).copy_(t)
        finally:
            mode.quiet -= 1
        return out, None

    for orig, new in ((host.to_device, to_device), (host.to_host_later, to_host_later)):
        for m in [m for k, m in list(sys.modules.items()) if k.startswith("gradcomp.")]:
            for k in [k for k, v in vars(m).items() if v is orig]:
                put(m, k, new)

    def collective(f):
        def quiet(self, *a, **k):
            mode.quiet += 1
            try:
                return f(self, *a, **k)
            finally:
                mode.quiet -= 1
        return quiet

    for fn in ("allreduce", "allgather", "reduce_scatter", "all_to_all"):
        put(comm.Comm, fn, collective(getattr(comm.Comm, fn)))
    try:
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()


def gpu_launches(spec: str, layout: list[ParamSlice], seed: int = 0) -> collections.Counter:
    """What one warm compressed exchange of the bucket ``layout`` (world size 1) launches on
    a GPU besides its collectives, by op (see the module's docstring); its total is the
    launch count. Needs Triton (importable; nothing is compiled or run)."""
    name, cfg = build_config(spec, **({} if "warmup=" in spec else {"warmup": "none"}))
    state = State(name, cfg)
    x = torch.randn(sum(p.numel for p in layout), generator=torch.Generator().manual_seed(seed))
    mode = _Launches()
    with _posing_as_cuda(mode), mode:
        state.reduce(x.clone(), layout)  # warm: memory and layouts created
        bucket = x.clone()
        mode.on = True
        state.reduce(bucket, layout)
        mode.on = False
    return mode.counts
