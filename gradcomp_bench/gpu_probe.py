"""Where the GPU time goes (one CUDA device): kernel block/warp sweep, the DGC select broken
into its steps, and a torch.profiler table of one DDP step per method (NCCL, one rank).

    PYTHONPATH=. python3 -m gradcomp_bench.gpu_probe [sweep] [dgc] [segments] [select] [layout]
        [profile[@MODEL][=SPEC;SPEC]] [syncdebug]
"""
import math
import os
import sys

import torch
import triton

from gradcomp_bench import bench_kernels as bk
from gradcomp_bench.timing import measure
from gradcomp.compressors.topk import sparse_select
from gradcomp.kernels.segmented import CAPACITY_FACTOR, TARGET_FACTOR
from gradcomp.kernels import reference
from gradcomp.kernels import triton as tk

DEV = torch.device("cuda")
N = 25_000_000


def ms(fn):
    return measure(fn, DEV)["median_s"] * 1e3


def sweep():
    print("== block / warps sweep at n=%d (vs copy of the same bytes)" % N)
    keep = ("onebit_compress", "onebit_decompress", "ternary_compress", "ternary_decompress",
            "select_topk")
    cases = [c for c in bk._cases(N, DEV) if c[0] in keep]
    copies = {name: ms(bk._copy_fn(nbytes, DEV)) for name, nbytes, _, _ in cases}
    print(f"{'kernel':<20}" + "".join(f"{b:>7}/{w}w" for b in (2048, 4096, 8192, 16384) for w in (4, 8)))
    for name, nbytes, fn, _ in cases:
        cells = []
        for b in (2048, 4096, 8192, 16384):
            for w in (4, 8):
                tk.common.BLOCK, tk.common.NUM_WARPS = b, w
                cells.append(copies[name] / ms(fn))
        print(f"{name:<20}" + "".join(f"{c:>10.2f}" for c in cells))
    tk.common.BLOCK, tk.common.NUM_WARPS = 4096, 4


def dgc(n=N, ratio=0.001):
    print(f"== DGC select steps at n={n}, ratio={ratio} (ms, median)")
    x = torch.randn(n, device=DEV)
    k = max(1, math.ceil(ratio * n))
    target, capacity = math.ceil(TARGET_FACTOR * k), CAPACITY_FACTOR * k
    m = max(math.ceil(0.01 * n), math.ceil(32 * n / target))
    g = torch.Generator(device=DEV)
    g.manual_seed(0)
    sample = torch.randint(0, n, (m,), generator=g, device=DEV)
    thr = reference.sample_threshold(x, target, sample)
    nb = triton.cdiv(n, tk.common.BLOCK)
    counts = torch.empty(nb, dtype=torch.int32, device=DEV)
    start = torch.zeros(nb, dtype=torch.int64, device=DEV)
    cv = torch.zeros(capacity, device=DEV)
    ci = torch.zeros(capacity, dtype=torch.int32, device=DEV)
    tk.topk._count_kernel[(nb,)](x, thr, counts, n, BLOCK_=tk.common.BLOCK)
    start = torch.cumsum(counts, 0, dtype=torch.int64) - counts
    tk.topk._compact_kernel[(nb,)](x, thr, start, cv, ci, n, capacity, BLOCK_=tk.common.BLOCK)
    rows = {
        "copy of x (read+write)": lambda: torch.empty_like(x).copy_(x),
        "x.abs()": lambda: x.abs(),
        "generator + randint(m)": lambda: torch.randint(0, n, (m,), generator=torch.Generator(device=DEV).manual_seed(0), device=DEV),
        "x[sample].abs()": lambda: x[sample].abs(),
        "sample_threshold(x)": lambda: reference.sample_threshold(x, target, sample),
        "topk(sample, ks)": lambda: torch.topk(x[sample].abs(), max(1, target * m // n), sorted=False),
        "count kernel": lambda: tk.topk._count_kernel[(nb,)](x, thr, counts, n, BLOCK_=tk.common.BLOCK),
        "cumsum(counts)": lambda: torch.cumsum(counts, 0, dtype=torch.int64) - counts,
        "compact kernel": lambda: tk.topk._compact_kernel[(nb,)](x, thr, start, cv, ci, n, capacity, BLOCK_=tk.common.BLOCK),
        f"topk(cand {capacity}, {k})": lambda: torch.topk(cv.abs(), k, sorted=False),
        f"kthvalue(cand, {capacity - k + 1})": lambda: torch.kthvalue(cv.abs(), capacity - k + 1),
        "sort(cand)": lambda: torch.sort(cv.abs()),
        "select_topk (all)": lambda: tk.select_topk(x, thr, k, capacity),
        "sparse_select (all)": lambda: sparse_select(x, ratio, 0.01, seed=0),
        "torch.topk(x.abs(), k)": lambda: torch.topk(x.abs(), k, sorted=False),
    }
    for name, fn in rows.items():
        print(f"  {name:<34}{ms(fn):>9.4f}")


def select(n=N, ratio=0.001, sample_ratio=0.01):
    """DGC's segmented select on one parameter of n elements, step by step (ms): what
    `gradcomp-bench kernels`' dgc_select row times whole."""
    from gradcomp.kernels import segmented as sg
    x = torch.randn(n, device=DEV)
    pl = sg.topk_plan(((0, n),), n, ratio, sample_ratio, DEV)
    shifts = torch.zeros(1, dtype=torch.int64, device=DEV)
    thr = sg.sample(x, pl, shifts)[2]
    C = pl.slots
    find = sg.implementation("segment_candidates", x, "triton")
    val, idx = find(x, thr, pl.seg_of, pl.seg_start, pl.slot_base, pl.slot_end, C)
    k, cap, m, ks = sg.budget(n, ratio, sample_ratio)
    keys = torch.randint(0, 2**62, (m,), device=DEV)
    print(f"== segmented select at n={n}, ratio={ratio}: k={k}, capacity={cap}, sample {m} (ms)")
    rows = {
        "select (all: radix selects)": lambda: sg.select(x, pl, shifts),
        "select (all: sorts)": lambda: sg.select(x, pl, shifts, rank="sort"),
        "thresholds (radix select)": lambda: sg.thresholds(x, pl, shifts, "triton"),
        f"take_largest (radix select of {C})": lambda: sg._take_largest(val, idx, pl, "triton"),
        "sample (gather, keys, sort)": lambda: sg.sample(x, pl, shifts),
        f"torch.sort int64 keys ({m})": lambda: torch.sort(keys),
        f"torch.topk(sample |x|, {ks})": lambda: torch.topk(x[:m].abs(), max(ks, 1), sorted=False),
        "segment_candidates (triton)": lambda: find(x, thr, pl.seg_of, pl.seg_start, pl.slot_base,
                                                    pl.slot_end, C),
        f"take_largest (stable sort of {C + 1})": lambda: sg._take_largest(val, idx, pl, "sort"),
        "torch.topk(x.abs(), k)": lambda: torch.topk(x.abs(), k, sorted=False),
    }
    for name, fn in rows.items():
        print(f"  {name:<40}{ms(fn):>9.4f}")
    # the radix select's digit widths: 3 passes of 11/11/9 bits (bigger histograms) against
    # 7/8/8/8 (one more pass over the values)
    default = sg.RADIX_PASSES
    for passes in (default, ((24, 7), (16, 8), (8, 8), (0, 8))):
        sg.RADIX_PASSES = passes
        try:
            name = "select, radix passes " + "/".join(str(w) for _, w in passes)
            print(f"  {name:<40}{ms(lambda: sg.select(x, pl, shifts)):>9.4f}")
        finally:
            sg.RADIX_PASSES = default


def layout(model="gpt2_small"):
    """TernGrad's move of a bucket into its padded layer order and back, on the GPU: the
    int32 gathers it runs there against the CPU's runs (one torch.cat of views) (ms)."""
    from gradcomp_bench import models
    from gradcomp.compressors.base import ParamSlice
    from gradcomp.compressors.terngrad import _TernaryLayout
    with torch.device("meta"):
        named = list(models.build(model).named_parameters())
    params, off = [], 0
    for name, t in named:
        params.append(ParamSlice(name, tuple(t.shape), off, t.numel()))
        off += t.numel()
    lay = _TernaryLayout(params, [], off, DEV)
    # the gathers TernGrad ran on the GPU before: an int32 position per element
    starts = lay.starts.tolist()
    take = torch.cat([torch.arange(p.offset, p.offset + m, device=DEV) if m == p.numel else
                      torch.cat([torch.arange(p.offset, p.offset + p.numel, device=DEV),
                                 torch.zeros(m - p.numel, dtype=torch.int64, device=DEV)])
                      for p, m in zip(params, lay.sizes)]).int()
    back = torch.cat([torch.arange(a, a + p.numel, device=DEV)
                      for p, a in zip(params, starts)]).int()
    pad = torch.cat([torch.arange(a + p.numel, a + m, device=DEV)
                     for p, a, m in zip(params, starts, lay.sizes)])
    x = torch.randn(off, device=DEV)
    out = torch.empty(lay.npad, device=DEV)
    dst = torch.empty(off, device=DEV)
    ok = torch.equal(lay.to_padded(x, out.clone()),
                     torch.index_select(x, 0, take).index_fill_(0, pad, 0.0))
    print(f"== TernGrad layout of {model}: {len(params)} layers, {off} -> {lay.npad} (ms); "
          f"runs == gather: {ok}")
    rows = {
        "spread: index_select by take (+ pad fill)": lambda: torch.index_select(
            x, 0, take, out=out).index_fill_(0, pad, 0.0),
        "spread: runs (one cat)": lambda: lay.to_padded(x, out),
        "gather: index_select by back": lambda: torch.index_select(out, 0, back, out=dst),
        "gather: runs (one cat)": lambda: lay.to_x(out, dst),
        "copy of x": lambda: dst.copy_(x),
    }
    for name, fn in rows.items():
        print(f"  {name:<44}{ms(fn):>9.4f}")


def segments(model="gpt2_small"):
    """torch.segment_reduce over a model's parameters as one flat gradient (what TernGrad's
    statistics and DGC's clip run on the GPU), against multi-tensor ops over its views."""
    from gradcomp_bench import models
    with torch.device("meta"):
        sizes = [p.numel() for p in models.build(model).parameters()]
    n = sum(sizes)
    y = torch.randn(n, device=DEV)
    lengths = torch.tensor(sizes, device=DEV)
    parts = y.split(sizes)
    print(f"== segment reductions over {model}'s {len(sizes)} parameters, {n} elements (ms)")
    rows = {f"segment_reduce {r}": (lambda r=r: torch.segment_reduce(y, r, lengths=lengths))
            for r in ("sum", "mean", "max")}
    rows["y.sum() (one segment)"] = lambda: y.sum()
    rows["_foreach_max(views)"] = lambda: torch._foreach_max(parts)
    rows["_foreach_norm(views, 2)"] = lambda: torch._foreach_norm(parts, 2)
    for name, fn in rows.items():
        print(f"  {name:<34}{ms(fn):>9.3f}")


def profile(methods=("dgc:ratio=0.001", "onebit", "powersgd:rank=2"), model="resnet18"):
    """torch.profiler over 3 DDP steps per method (one rank, NCCL): the top ops by self CPU
    time and by self CUDA time. ResNet-18 with momentum SGD (batch 128), or a language model
    (``model=gpt2_small``: 8 windows of its context) with AdamW as ``gradcomp-bench ddp``
    runs it."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import gradcomp
    from gradcomp_bench import models
    from gradcomp.hooks import parse_spec
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    lm = model in models.LANGUAGE_MODELS
    for spec in methods:
        torch.manual_seed(0)
        net = models.build(model).to(DEV)
        if lm:
            xb = torch.randint(0, 128, (8, net.context), device=DEV)
            yb = torch.randint(0, 128, (8, net.context), device=DEV)
            opt = torch.optim.AdamW(models.decay_groups(net, 0.1), lr=1e-4, betas=(0.9, 0.95))
        else:
            xb = torch.randn(128, 3, 32, 32, device=DEV)
            yb = torch.randint(0, 10, (128,), device=DEV)
            opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        net = DDP(net, device_ids=[0], broadcast_buffers=False)
        name, opts = parse_spec(spec)
        if name != "allreduce":  # the compressed steady state, as `gradcomp-bench ddp` times it
            opts.setdefault("warmup", "none")
            if lm:
                opts.setdefault("adam", "off")
        state = None if name == "allreduce" else gradcomp.register(net, name, optimizer=opt, **opts)

        def step():
            opt.zero_grad()
            out = net(xb)
            torch.nn.functional.cross_entropy(out.flatten(0, -2), yb.flatten()).backward()
            opt.step()
        for _ in range(8):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        for key in ("self_cpu_time_total", "self_cuda_time_total"):
            print(f"== profile {model} {spec}: 3 steps, top ops by {key}")
            print(ka.table(sort_by=key, row_limit=22, max_name_column_width=60))
        syncs = [(e.key, e.count) for e in ka if "ynchronize" in e.key or "Memcpy" in e.key
                 or e.key.startswith("gradcomp.")]
        print("syncs/copies/buckets:", syncs)
        if state is not None:
            state.close()
        del net, opt
    dist.destroy_process_group()


SYNC_METHODS = ("allreduce", "dgc", "topk", "onebit", "terngrad", "threshold", "powersgd",
                "sparseloco", "diloco")


def syncdebug(methods=SYNC_METHODS, steps=8):
    """Host waits in compressed steps: every method under DDP (several buckets) and FSDP2 (one
    rank, NCCL, momentum SGD, ``warmup="none"``; on a 1x1 HSDP mesh, where one rank's
    exchange runs: a 1-D mesh of one rank has nothing to reduce-scatter),
    ``torch.cuda.set_sync_debug_mode("warn")`` around ``steps`` training steps after 4
    unwatched ones. Prints and returns, per adapter and method, the
    number of synchronizing calls and the source lines that made them (the optimizer's and
    the model's own are listed too: plain DDP makes none)."""
    import collections
    import json
    import warnings
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    import gradcomp
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("replicate", "shard"))
    out = {}
    for adapter in ("ddp", "fsdp"):
        for name in methods:
            torch.manual_seed(0)
            net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(512, 512), nn.GELU())],
                                nn.Linear(512, 10)).to(DEV)
            if adapter == "ddp":
                net = DDP(net, device_ids=[0], bucket_cap_mb=1)
            else:
                for m in net[::2]:
                    fully_shard(m, mesh=mesh)
                net = fully_shard(net, mesh=mesh)
            opt = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
            kw = {} if name == "allreduce" else {"warmup": "none"}
            try:
                state = gradcomp.register(net, name, optimizer=opt, **kw)
            except Exception as e:  # noqa: BLE001  (a refusal is a row too)
                out[f"{adapter}/{name}"] = {"refused": str(e)[:200]}
                print(f"== {adapter} {name}: refused: {str(e)[:200]}")
                continue
            x = torch.randn(64, 512, device=DEV)
            y = torch.randint(0, 10, (64,), device=DEV)

            def step():
                opt.zero_grad()
                nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
            for _ in range(4):
                step()
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(steps):
                        step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            where = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in seen
                                        if "synchroniz" in str(w.message))
            st = state.stats()
            row = {"syncs": sum(where.values()), "per_step": sum(where.values()) / steps,
                   "where": dict(where.most_common()), "compressing_since": st.get("compressing_since"),
                   "run_ratio": st.get("run_ratio")}
            out[f"{adapter}/{name}"] = row
            print(f"== {adapter} {name}: {row['syncs']} syncs in {steps} steps, "
                  f"compressing_since {row['compressing_since']}, run_ratio {row['run_ratio']}")
            for k, v in where.most_common(8):
                print(f"    {v:>4}  {k}")
            state.close()
            del net, opt
    dist.destroy_process_group()
    path = os.environ.get("SYNC_JSON")
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "steps": steps, "rows": out}, f,
                      indent=1)
    return out


if __name__ == "__main__":
    what = sys.argv[1:] or ["sweep", "dgc", "profile"]
    for w in what:
        if w.startswith("profile"):  # profile[@model]=spec;spec
            head, _, specs = w.partition("=")
            model = head.partition("@")[2] or "resnet18"
            profile(tuple(specs.split(";")) if specs else profile.__defaults__[0], model)
        else:
            {"sweep": sweep, "dgc": dgc, "segments": segments, "select": select,
             "layout": layout, "syncdebug": syncdebug}[w]()
