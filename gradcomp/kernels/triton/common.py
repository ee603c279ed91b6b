"""What every Triton kernel module shares: the block size, warps, output allocation and input
checks. ``BLOCK`` and ``alloc`` are read at call time (tests shrink the one and swap the
other)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..reference import check_flat  # noqa: F401  (the kernels check their inputs with it)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Elements per program (a power of two, >= 64). Native: 2048 with 4 warps, chosen by a sweep
# on an H100 (bench/gpu_probe.py sweep, recorded in bench/RESULTS.md): at 25M elements it puts
# every quantize/pack/unpack kernel at 78-121% of the bandwidth of a copy of the same bytes, where
# 4096 left ternary_decompress at 60% and 16384 collapsed (register spills). The
# interpreter runs programs one after another in Python, so its cost is per program: 65536
# keeps a 4M-element test at a few seconds. Read at call time, so tests can shrink it to
# exercise many programs.
BLOCK = 65536 if INTERPRET else 2048
NUM_WARPS = 4

U64 = (1 << 64) - 1


def alloc(shape, dtype, device) -> torch.Tensor:
    """Every output buffer comes from here (tests swap in guard-banded buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


def check_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} with strides "
                         f"{t.stride()}; call .contiguous() first")


def check_fp32(t: torch.Tensor, name: str, n: int) -> None:
    check_flat(t, name)
    if t.dtype != torch.float32 or t.numel() != n:
        raise ValueError(f"{name} must be fp32 with {n} elements, got {t.dtype} with {t.numel()}")


@triton.jit
def store_sum(out_ptr, off, mask, v, ACCUMULATE: tl.constexpr):
    """A decoder's result ``v`` into out: added to what out holds, or (``ACCUMULATE``
    False) written without reading out, as 0 + v: what a zeroed out would get, -0.0 coming
    out +0.0 and NaN staying NaN."""
    if ACCUMULATE:
        o = tl.load(out_ptr + off, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + off, o + v, mask=mask)
    else:
        tl.store(out_ptr + off, tl.where(v == 0.0, 0.0, v), mask=mask)
