"""The benchmarks' one timer: ``triton.testing.do_bench`` on a GPU (L2 cache flushed before
each call; without Triton, torch's Timer, which synchronizes CUDA), and
``torch.utils.benchmark.Timer`` on the CPU (blocks of calls until the spread settles)."""
from __future__ import annotations

import statistics

import torch
from torch.utils.benchmark import Timer

MAX_SECONDS = 2.0  # per measurement on the CPU: the slowest reference paths take ~0.5 s a call


def measure(fn, device: torch.device, max_seconds: float = MAX_SECONDS) -> dict:
    """Seconds per call of ``fn()``: ``median_s``, ``p20_s``, ``p80_s`` and ``runs`` (calls
    timed). On the CPU each sample is one block's mean per call; on a GPU one call each."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            times = [t / 1e3 for t in do_bench(fn, warmup=25, rep=100, return_mode="all")]
            return _summary(times, len(times))
    m = Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).adaptive_autorange(
        threshold=0.1, max_run_time=max_seconds)
    return _summary(m.times, len(m.times) * m.number_per_run)


def _summary(times: list[float], runs: int) -> dict:
    times = sorted(times)
    if len(times) == 1:
        return {"median_s": times[0], "p20_s": times[0], "p80_s": times[0], "runs": runs}
    deciles = statistics.quantiles(times, n=10, method="inclusive")
    return {"median_s": statistics.median(times), "p20_s": deciles[1], "p80_s": deciles[7],
            "runs": runs}
