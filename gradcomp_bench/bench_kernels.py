"""Micro-benchmarks of the quantize and select steps.

For each kernel and size, three timings of the same work on one device:
  * ``dispatch``: ``gradcomp.kernels.<fn>``, what the compressors call (Triton on CUDA; on
    the CPU the blocked path of :mod:`gradcomp.kernels.cpu` where it has one,
    the torch reference for the others);
  * ``reference``: ``gradcomp.kernels.reference.<fn>``;
  * ``copy``: ``dst.copy_(src)`` moving as many bytes as the kernel must read plus write,
    the bandwidth yardstick.
plus DGC's select at ratio 0.001 (what the hook runs, ``segmented.select`` on one
parameter, and its per-parameter reference ``sparse_select``) against
``torch.topk(x.abs(), k)``.

Each row holds the median and 20/80 percentile times, the effective bandwidth (bytes the
operation must move at least, i.e. one read of each input and one write of each output,
over the median time), ``vs_copy`` (copy time / this time: 1.0 runs at copy speed), the
torch and triton versions and the git SHA. Timings come from :func:`.timing.measure`
(``triton.testing.do_bench`` on a GPU, ``torch.utils.benchmark.Timer`` on the CPU).

    from gradcomp_bench import bench_kernels as b
    print(b.format_table(b.run(sizes=(1 << 20, 1 << 24))))
"""
from __future__ import annotations

import math
import os
import subprocess

import torch

from gradcomp import kernels
from gradcomp.compressors.topk import sparse_select
from gradcomp.kernels import segmented
from gradcomp.kernels.segmented import CAPACITY_FACTOR, TARGET_FACTOR
from gradcomp.compressors.onebit import OneBitConfig
from gradcomp.kernels import reference

from . import report, timing

CHUNK = OneBitConfig().chunk  # the default the method runs with (256)
W = 4                  # messages decoded per decompress / scattered per scatter_add
TOPK_RATIO = 0.01      # TopKConfig's default
DGC_RATIO = 0.001      # DGCConfig's default
DGC_SAMPLE_RATIO = 0.01
SEGMENT = 1 << 16      # elements per TernGrad segment (one layer's scaler)


def _git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "none"


def _cases(n: int, device: torch.device):
    """(kernel, bytes moved, dispatch fn, reference fn) for size n, inputs built once."""
    g = torch.Generator(device=device)
    g.manual_seed(n)
    x = torch.randn(n, generator=g, device=device)
    res = torch.randn(n, generator=g, device=device) * 0.1
    nchunks = n // CHUNK

    # 1-bit: n rounded down to whole chunks
    n1 = nchunks * CHUNK
    x1, r1, r1b = x[:n1], res[:n1].clone(), res[:n1].clone()
    bits, scales = reference.onebit_compress(x1, None, CHUNK)
    wbits, wscales = bits.expand(W, -1).contiguous(), scales.expand(W, -1, -1).contiguous()
    out1, out1b = torch.zeros(n1, device=device), torch.zeros(n1, device=device)
    yield ("onebit_compress", 12 * n1 + n1 // 8 + 8 * nchunks,
           lambda: kernels.onebit_compress(x1, r1, CHUNK),
           lambda: reference.onebit_compress(x1, r1b, CHUNK))
    yield ("onebit_decompress", W * (n1 // 8 + 8 * nchunks) + 8 * n1,
           lambda: kernels.onebit_decompress(wbits, wscales, CHUNK, out1),
           lambda: reference.onebit_decompress(wbits, wscales, CHUNK, out1b))

    # TernGrad: n rounded down to a multiple of 4, one scaler per SEGMENT elements
    n4 = n - n % 4
    x4, r4, r4b = x[:n4], res[:n4].clone(), res[:n4].clone()
    seg = torch.arange(n4, device=device) // SEGMENT
    nseg = -(-n4 // SEGMENT)
    scale = torch.zeros(nseg, device=device).scatter_reduce_(0, seg, (x4 + r4).abs() * 2, "amax")
    packed = reference.ternary_compress(x4, None, scale, seg, 0)
    wpacked, wscale = packed.expand(W, -1).contiguous(), scale.expand(W, -1).contiguous()
    out4, out4b = torch.zeros(n4, device=device), torch.zeros(n4, device=device)
    yield ("ternary_compress", 16 * n4 + seg.element_size() * n4 + n4 // 4,
           lambda: kernels.ternary_compress(x4, r4, scale, seg, 1),
           lambda: reference.ternary_compress(x4, r4b, scale, seg, 1))
    yield ("ternary_decompress", W * n4 // 4 + seg.element_size() * n4 + 8 * n4,
           lambda: kernels.ternary_decompress(wpacked, wscale, seg, out4),
           lambda: reference.ternary_decompress(wpacked, wscale, seg, out4b))

    # top-k select at TopK's default ratio, threshold from a sample (not timed here)
    k = max(1, math.ceil(TOPK_RATIO * n))
    target, capacity = min(n, math.ceil(TARGET_FACTOR * k)), min(n, CAPACITY_FACTOR * k)
    sample = torch.randint(0, n, (max(1, n // 100),), generator=g, device=device)
    thr = reference.sample_threshold(x, target, sample)
    yield ("select_topk", 4 * n + 8 * capacity,
           lambda: kernels.select_topk(x, thr, k, capacity),
           lambda: reference.select_topk(x, thr, k, capacity))

    # scatter-add of W messages of k (value, int32 index) pairs
    vals = torch.randn(W, k, generator=g, device=device)
    idx = torch.randint(0, n, (W, k), generator=g, device=device, dtype=torch.int32)
    outs, outsb = torch.zeros(n, device=device), torch.zeros(n, device=device)
    yield ("scatter_add", 16 * W * k,  # value + index read, out element read and written
           lambda: kernels.scatter_add(vals, idx, outs),
           lambda: reference.scatter_add(vals, idx, outsb))


def _copy_fn(nbytes: int, device: torch.device):
    half = max(1, nbytes // 8)  # fp32 elements: reads 4 * half, writes 4 * half
    src = torch.ones(half, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def run(sizes=(1 << 20, 25_000_000), device=None,
        max_seconds: float = timing.MAX_SECONDS) -> list[dict]:
    """Time every kernel at every size; one dict per (kernel, size, path). See the module
    docstring for the fields."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": _triton_version(), "git": _git_sha()}
    rows = []

    def row(kernel, n, path, backend, nbytes, fn, copy_median):
        t = timing.measure(fn, device, max_seconds)
        med = t["median_s"]
        rows.append({"kernel": kernel, "n": n, "path": path, "backend": backend, "bytes": nbytes,
                     "median_ms": med * 1e3, "p20_ms": t["p20_s"] * 1e3, "p80_ms": t["p80_s"] * 1e3,
                     "gbps": nbytes / med / 1e9,
                     "vs_copy": (copy_median or med) / med, "repeats": t["runs"], **meta})
        return med

    for n in sizes:
        probe = torch.empty(1, device=device)
        for kernel, nbytes, dispatch_fn, ref_fn in _cases(n, device):
            copy_med = row(kernel, n, "copy", "torch", nbytes, _copy_fn(nbytes, device), None)
            impl = kernels.backend(kernel, probe)
            row(kernel, n, "dispatch", impl, nbytes, dispatch_fn, copy_med)
            row(kernel, n, "reference", "reference", nbytes, ref_fn, copy_med)

        # DGC: sampled threshold + select_topk at ratio 0.001 vs an exact top-k of |x|
        x = torch.randn(n, generator=torch.Generator(device=device).manual_seed(n), device=device)
        k = max(1, math.ceil(DGC_RATIO * n))
        nbytes = 4 * n + 8 * k
        copy_med = row("dgc_select", n, "copy", "torch", nbytes, _copy_fn(nbytes, device), None)
        # what the hook runs (segmented.select: the GPU's candidates in Triton), and the
        # per-parameter reference it equals (a sort over the candidates)
        pl = segmented.topk_plan(((0, n),), n, DGC_RATIO, DGC_SAMPLE_RATIO, device)
        shifts = torch.zeros(1, dtype=torch.int64, device=device)
        row("dgc_select", n, "dispatch", kernels.backend("select_topk", probe), nbytes,
            lambda: segmented.select(x, pl, shifts), copy_med)
        row("dgc_select", n, "reference", "reference", nbytes,
            lambda: sparse_select(x, DGC_RATIO, DGC_SAMPLE_RATIO, seed=0), copy_med)
        row("dgc_select", n, "torch.topk", "torch", nbytes,
            lambda: torch.topk(x.abs(), k, sorted=False), copy_med)
    return rows


COLUMNS = [("kernel", "kernel", ""), ("n", "n", "d"), ("path", "path", ""),
           ("backend", "backend", ""), ("median_ms", "median ms", ".3f"), ("p20_ms", "p20 ms", ".3f"),
           ("p80_ms", "p80 ms", ".3f"), ("gbps", "GB/s", ".2f"), ("vs_copy", "vs copy", ".2f"),
           ("repeats", "runs", "d")]


def format_table(rows: list[dict]) -> str:
    """:func:`run`'s rows as a text table, under a line naming the setup."""
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    return (f"device {r0['device']}  torch {r0['torch']}  triton {r0['triton']}  git {r0['git']}\n"
            + report.table(rows, COLUMNS))
