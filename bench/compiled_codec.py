"""The 1-bit or TernGrad steps on the CPU, side by side: reference vs the blocked pure-torch
path (kernels/cpu.py) vs the torch.compile'd path (kernels/compiled.py), one process.

    python bench/compiled_codec.py --sizes 1048576,11173962 --repeats 5
    python bench/compiled_codec.py --method terngrad --sizes 1048576,11173962 --repeats 3

TernGrad: the bucket is cut into ``--layers`` equal layers (a seed and a scaler each); its
encoder has no blocked path (the "cpu" column runs the reference), its encode is without a
residual (TernGrad's default), and its compiled steps are bit-identical to the reference.

Each repeat times every backend in turn (so load on a shared machine hits them alike) over
``max(1, 2^22 // n)`` calls; the table is the median per call over the repeats, wall time
and the process's CPU time (all threads; less sensitive to other processes' load). Encode is
with a residual (error feedback); decode accumulates W messages with alpha = 1/W. Sizes are
rounded down to whole chunks. The first compile's time (this process) is printed too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from gradcomp.kernels import compiled, cpu, reference


BACKENDS = (("reference", reference), ("cpu", cpu), ("compiled", compiled))


def header(a, extra: str) -> None:
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()}, {extra}")


def first_calls(calls) -> None:
    """Time each (step, fn)'s first call: the compile (or a warm cache's load)."""
    for step, fn in calls:
        t = time.perf_counter()
        fn()
        print(f"first {step} call (compile) {time.perf_counter() - t:.1f} s")
    print("| step | elements | reference ms | cpu ms | compiled ms | reference cpu-ms | cpu cpu-ms"
          " | compiled cpu-ms |")
    print("|---|---|---|---|---|---|---|---|")


def time_row(label: str, n: int, repeats: int, call) -> None:
    """One table row: ``call(module)`` per backend, each repeat timing every backend in
    turn over ``max(1, 2^22 // n)`` calls; medians per call, wall and CPU time."""
    iters = max(1, (1 << 22) // n)
    times = {m: [] for m, _ in BACKENDS}
    cpus = {m: [] for m, _ in BACKENDS}
    for _ in range(repeats):
        for m, mod in BACKENDS:
            t, c = time.perf_counter(), time.process_time()
            for _ in range(iters):
                call(mod)
            times[m].append((time.perf_counter() - t) / iters * 1e3)
            cpus[m].append((time.process_time() - c) / iters * 1e3)
    med = {m: statistics.median(v) for m, v in times.items()}
    cmed = {m: statistics.median(v) for m, v in cpus.items()}
    print(f"| {label} | {n} | {med['reference']:.2f} | {med['cpu']:.2f} | "
          f"**{med['compiled']:.2f}** | {cmed['reference']:.2f} | {cmed['cpu']:.2f} | "
          f"{cmed['compiled']:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1048576,11173962")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--W", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--method", choices=("onebit", "terngrad"), default="onebit")
    p.add_argument("--layers", type=int, default=60, help="terngrad: layers per bucket")
    a = p.parse_args()
    (terngrad if a.method == "terngrad" else onebit)(a)
    print(f"load after {os.getloadavg()}")


def onebit(a) -> None:
    chunk, W = a.chunk, a.W
    header(a, f"chunk {chunk}, W {W}")
    warm = torch.randn(1 << 17)
    first_calls((("encode", lambda: compiled.onebit_compress(warm, warm.clone(), chunk)),
                 ("decode", lambda: compiled.onebit_decompress(
                     torch.zeros(W, (1 << 17) // 8, dtype=torch.uint8),
                     torch.zeros(W, 2, (1 << 17) // chunk), chunk, warm.clone(), 1 / W))))
    for n in (int(s) for s in a.sizes.split(",")):
        n -= n % chunk
        g = torch.Generator().manual_seed(0)
        x, r = torch.randn(n, generator=g), torch.randn(n, generator=g)
        bits = torch.randint(0, 256, (W, n // 8), generator=g, dtype=torch.uint8)
        scales = torch.randn(W, 2, n // chunk, generator=g)
        out = torch.zeros(n)
        time_row("onebit encode", n, a.repeats, lambda mod: mod.onebit_compress(x, r, chunk))
        time_row(f"onebit decode (W={W})", n, a.repeats,
                 lambda mod: mod.onebit_decompress(bits, scales, chunk, out, 1 / W))


def terngrad(a) -> None:
    W, S = a.W, a.layers
    header(a, f"W {W}, layers {S}")

    def case(n):
        n -= n % (4 * S)
        g = torch.Generator().manual_seed(0)
        lengths = torch.full((S,), n // S)
        starts = torch.arange(S) * (n // S)
        seg = torch.repeat_interleave(torch.arange(S, dtype=torch.int32), lengths)
        x = torch.randn(n, generator=g)
        scale = torch.segment_reduce(x.abs(), "max", lengths=lengths)
        seeds = torch.randint(0, 2**62, (S,), generator=g)
        packed = torch.stack([reference.ternary_compress(x, None, scale, seg, seeds + w, starts)
                              for w in range(W)])
        return n, x, scale, seg, seeds, starts, packed, scale.expand(W, S).contiguous()

    def encode(mod, c):  # no blocked encoder: cpu.py's column runs the reference
        n, x, scale, seg, seeds, starts, _, _ = c
        getattr(mod, "ternary_compress", reference.ternary_compress)(x, None, scale, seg, seeds, starts)

    def decode(mod, c, out):
        mod.ternary_decompress(c[6], c[7], c[3], out, 1 / W)

    warm = case(1 << 18)  # past MIN_NUMEL
    first_calls((("encode", lambda: encode(compiled, warm)),
                 ("decode", lambda: decode(compiled, warm, torch.zeros(warm[0])))))
    for size in (int(s) for s in a.sizes.split(",")):
        c = case(size)
        out = torch.zeros(c[0])
        time_row("terngrad encode", c[0], a.repeats, lambda mod: encode(mod, c))
        time_row(f"terngrad decode (W={W})", c[0], a.repeats, lambda mod: decode(mod, c, out))


if __name__ == "__main__":
    main()
