"""How many aten ops one bucket's exchange costs, per method (the codec issue's measure).

Every op ``GradcompState.reduce`` dispatches for one bucket at world size 1 is counted with
a TorchDispatchMode (on a GPU each is at least one kernel launch). Layouts: DDP's 25 MB
buckets of ResNet-18 and of GPT-2 small's parameter shapes, and 1M elements cut into 16 or
160 tensors (the issue's check that the count does not grow with the tensor count). A warm
step runs first, so memory creation is not counted.
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradcomp.compressors.base import ParamSlice
from gradcomp.hooks import build_config
from gradcomp.hooks.state import GradcompState

SPECS = ("allreduce", "topk", "dgc", "onebit", "terngrad", "powersgd", "threshold")
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
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


def count(spec: str, layout: list[ParamSlice], seed: int = 0) -> int:
    """aten ops of one warm exchange of the bucket ``layout`` (world size 1)."""
    name, cfg = build_config(spec)
    state = GradcompState(name, cfg)
    n = sum(p.numel for p in layout)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    state.reduce(x.clone(), layout)  # warm: memory created
    mode = _Count()
    with mode:
        state.reduce(x.clone(), layout)
    return mode.n


def run(specs=SPECS) -> list[dict]:
    layouts = {"16 tensors, 1M": [buckets(even_shapes(2**20, 16), 2**40)[0]],
               "160 tensors, 1M": [buckets(even_shapes(2**20, 160), 2**40)[0]],
               "resnet18": buckets(resnet18_shapes()),
               "gpt2-small": buckets(gpt2_small_shapes())}
    rows = []
    for spec in specs:
        for key, bs in layouts.items():
            ops = [count(spec, b) for b in bs]
            rows.append({"method": spec, "layout": key, "buckets": len(bs),
                         "tensors": sum(len(b) for b in bs), "ops_per_step": sum(ops),
                         "max_ops_per_bucket": max(ops)})
    return rows
