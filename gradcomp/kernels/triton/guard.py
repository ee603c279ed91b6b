"""The inf/NaN guard's Triton kernel (hooks/guard.py): finite_copy, as kernels/reference.py
specifies it (see kernels/triton/__init__.py). One launch in place of the check's and the
copy's seven (isfinite's four, all, not, nan_to_num)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import check_guard
from . import common as c


@triton.jit
def _finite_copy_kernel(
    x_ptr,     # (n,) x, fp32/fp16/bf16                                 reads n elements
    out_ptr,   # (n,) x with NaN and +-inf put to 0, x's dtype          writes n elements
    flag_ptr,  # (>= 1,) fp32: [0] set to 1 where a program saw one     one store at most
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0)
    ok = tl.abs(v.to(tl.float32)) < float("inf")  # False for NaN too
    # the value itself where finite (its bits, -0.0 included), else 0
    tl.store(out_ptr + offs, tl.where(ok, v, tl.zeros_like(v)), mask=mask)
    nbad = tl.sum((mask & ~ok).to(tl.int32), axis=0)
    tl.store(flag_ptr, 1.0, mask=nbad > 0)  # every writer writes the same value


def finite_copy(x: torch.Tensor, flag: torch.Tensor, out: torch.Tensor | None = None
                ) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.finite_copy`. Reads n, writes n (each element
    in its own lane: ``out`` may be x)."""
    check_guard(x, flag, out)
    c.check_contiguous(flag, "flag")
    n = x.numel()
    out = c.alloc((n,), x.dtype, x.device) if out is None else out
    if n:
        _finite_copy_kernel[(triton.cdiv(n, c.BLOCK),)](x, out, flag, n, BLOCK=c.BLOCK,
                                                        num_warps=c.NUM_WARPS)
    return out


@triton.jit
def _flag_fill_kernel(
    out_ptr,   # (n,) fp32/fp16/bf16, in place           writes n elements where flagged
    flag_ptr,  # (>= 1,) fp32: NaN everywhere where [0] > 0
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    up = tl.load(flag_ptr + tl.zeros((BLOCK,), tl.int32)) > 0  # the flag, in every lane
    nan = tl.full((BLOCK,), float("nan"), tl.float32).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, nan, mask=(offs < n) & up)


def flag_fill(out: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.flag_fill`. One launch in place of two (the
    comparison and the masked fill); reads nothing of out."""
    check_guard(out, flag, x_name="out")
    n = out.numel()
    if n:
        _flag_fill_kernel[(triton.cdiv(n, c.BLOCK),)](out, flag, n, BLOCK=c.BLOCK,
                                                      num_warps=c.NUM_WARPS)
    return out
