"""One bucket exchange of ResNet-18's 11.2M gradient elements, world size 1, on the CPU:
``gradcomp.State.reduce`` per method and kernel path, seconds per call (median of 3 after
one warm call, which compiles where the path compiles).

    PYTHONPATH=. python bench/reduce_cpu.py --threads 1 --methods terngrad,onebit

What it measures is the codec's CPU cost of a step without a network: the layout moves, the
statistics and the kernels, in one process (no collectives cross a link at world size 1).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import gradcomp
from gradcomp.compressors.base import ParamSlice
from gradcomp_bench import models


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--methods", default="terngrad,onebit")
    p.add_argument("--paths", default="cpu,auto", help="GRADCOMP_KERNELS values to compare")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    params, off = [], 0
    for name, t in models.build("resnet18").named_parameters():
        params.append(ParamSlice(name, tuple(t.shape), off, t.numel()))
        off += t.numel()
    print(f"torch {torch.__version__}, threads {a.threads}, load {os.getloadavg()}, {off} elements")
    x = torch.randn(off, generator=torch.Generator().manual_seed(0))
    for spec in a.methods.split(","):
        for path in a.paths.split(","):
            os.environ["GRADCOMP_KERNELS"] = path
            name, cfg = gradcomp.build_config(spec, warmup="none")
            state = gradcomp.State(name, cfg)
            buf = x.clone()  # one bucket, refilled outside the timing (as DDP's is reused)
            state.reduce(buf, params)
            times = []
            for _ in range(a.repeats):
                buf.copy_(x)
                t = time.perf_counter()
                state.reduce(buf, params)
                times.append(time.perf_counter() - t)
            print(f"| {spec} | {path} | {statistics.median(times):.3f} |", flush=True)
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
