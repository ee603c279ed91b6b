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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1048576,11173962")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--W", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--method", choices=("onebit", "terngrad"), default="onebit")
    p.add_argument("--layers", type=int, default=60, help="terngrad: layers per bucket")
    a = p.parse_args()
    if a.method == "terngrad":
        return terngrad(a)
    chunk, W = a.chunk, a.W
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()}, chunk {chunk}, W {W}")
    warm = torch.randn(1 << 17)
    for step, fn in (("encode", lambda: compiled.onebit_compress(warm, warm.clone(), chunk)),
                     ("decode", lambda: compiled.onebit_decompress(
                         torch.zeros(W, (1 << 17) // 8, dtype=torch.uint8),
                         torch.zeros(W, 2, (1 << 17) // chunk), chunk, warm.clone(), 1 / W))):
        t = time.perf_counter()
        fn()
        print(f"first {step} call (compile) {time.perf_counter() - t:.1f} s")
    print("| step | elements | reference ms | cpu ms | compiled ms | reference cpu-ms | cpu cpu-ms"
          " | compiled cpu-ms |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(s) for s in a.sizes.split(",")):
        n -= n % chunk
        g = torch.Generator().manual_seed(0)
        x, r = torch.randn(n, generator=g), torch.randn(n, generator=g)
        bits = torch.randint(0, 256, (W, n // 8), generator=g, dtype=torch.uint8)
        scales = torch.randn(W, 2, n // chunk, generator=g)
        out = torch.zeros(n)
        iters = max(1, (1 << 22) // n)
        for step in ("encode", "decode"):
            times = {m: [] for m in ("reference", "cpu", "compiled")}
            cpus = {m: [] for m in times}
            for _ in range(a.repeats):
                for m, mod in (("reference", reference), ("cpu", cpu), ("compiled", compiled)):
                    t, c = time.perf_counter(), time.process_time()
                    for _ in range(iters):
                        if step == "encode":
                            mod.onebit_compress(x, r, chunk)
                        else:
                            mod.onebit_decompress(bits, scales, chunk, out, 1 / W)
                    times[m].append((time.perf_counter() - t) / iters * 1e3)
                    cpus[m].append((time.process_time() - c) / iters * 1e3)
            med = {m: statistics.median(v) for m, v in times.items()}
            cmed = {m: statistics.median(v) for m, v in cpus.items()}
            print(f"| onebit {step} | {n} | {med['reference']:.2f} | {med['cpu']:.2f} | "
                  f"**{med['compiled']:.2f}** | {cmed['reference']:.2f} | {cmed['cpu']:.2f} | "
                  f"{cmed['compiled']:.2f} |", flush=True)
    print(f"load after {os.getloadavg()}")


def terngrad(a) -> None:
    W, S = a.W, a.layers
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()}, W {W}, layers {S}")

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

    n, x, scale, seg, seeds, starts, packed, scales = case(1 << 18)  # past MIN_NUMEL
    for step, fn in (("encode", lambda: compiled.ternary_compress(x, None, scale, seg, seeds, starts)),
                     ("decode", lambda: compiled.ternary_decompress(packed, scales, seg,
                                                                    torch.zeros(n), 1 / W))):
        t = time.perf_counter()
        fn()
        print(f"first {step} call (compile) {time.perf_counter() - t:.1f} s")
    print("| step | elements | reference ms | cpu ms | compiled ms | reference cpu-ms | cpu cpu-ms"
          " | compiled cpu-ms |")
    print("|---|---|---|---|---|---|---|---|")
    for size in (int(s) for s in a.sizes.split(",")):
        n, x, scale, seg, seeds, starts, packed, scales = case(size)
        out = torch.zeros(n)
        iters = max(1, (1 << 22) // n)
        for step in ("encode", "decode"):
            times = {m: [] for m in ("reference", "cpu", "compiled")}
            cpus = {m: [] for m in times}
            for _ in range(a.repeats):
                for m, mod in (("reference", reference), ("cpu", cpu), ("compiled", compiled)):
                    t, c = time.perf_counter(), time.process_time()
                    for _ in range(iters):
                        if step == "encode":
                            getattr(mod, "ternary_compress", reference.ternary_compress)(
                                x, None, scale, seg, seeds, starts)
                        else:
                            mod.ternary_decompress(packed, scales, seg, out, 1 / W)
                    times[m].append((time.perf_counter() - t) / iters * 1e3)
                    cpus[m].append((time.process_time() - c) / iters * 1e3)
            med = {m: statistics.median(v) for m, v in times.items()}
            cmed = {m: statistics.median(v) for m, v in cpus.items()}
            print(f"| terngrad {step} | {n} | {med['reference']:.2f} | {med['cpu']:.2f} | "
                  f"**{med['compiled']:.2f}** | {cmed['reference']:.2f} | {cmed['cpu']:.2f} | "
                  f"{cmed['compiled']:.2f} |", flush=True)
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
