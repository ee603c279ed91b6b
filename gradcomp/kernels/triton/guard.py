"""The inf/NaN guard's Triton kernels (hooks/guard.py): finite_copy and flag_fill, as
kernels/reference.py specifies them (see kernels/triton/__init__.py). finite_copy is one
launch in place of the check's and the copy's seven (isfinite's four, all, not, nan_to_num)
and the flag's copy from the host (it writes the step itself); flag_fill one in place of two
(the comparison and the masked fill) and the next flag's clearing."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import check_clear, check_guard
from . import common as c


@triton.jit
def _finite_copy_kernel(
    x_ptr,     # (n,) x, fp32/fp16/bf16                                 reads n elements
    out_ptr,   # (n,) x with NaN and +-inf put to 0, x's dtype          writes n elements
    flag_ptr,  # (>= 1,) fp32: [0] set to 1 where a program saw one     one store at most
    n,
    step,      # fp32: flag[1] = step, flag[2] = -step (program 0) where HAS_STEP
    HAS_STEP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if HAS_STEP:
        if pid == 0:
            tl.store(flag_ptr + 1, step)
            tl.store(flag_ptr + 2, -step)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0.0)
    ok = tl.abs(v.to(tl.float32)) < float("inf")  # False for NaN too
    # the value itself where finite (its bits, -0.0 included), else 0
    tl.store(out_ptr + offs, tl.where(ok, v, tl.zeros_like(v)), mask=mask)
    nbad = tl.sum((mask & ~ok).to(tl.int32), axis=0)
    tl.store(flag_ptr, 1.0, mask=nbad > 0)  # every writer writes the same value


def finite_copy(x: torch.Tensor, flag: torch.Tensor, out: torch.Tensor | None = None,
                step: float | None = None) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.finite_copy`. Reads n, writes n (each element
    in its own lane: ``out`` may be x)."""
    check_guard(x, flag, out, flag_len=1 if step is None else 3)
    c.check_contiguous(flag, "flag")
    n = x.numel()
    out = c.alloc((n,), x.dtype, x.device) if out is None else out
    # one program at least: an empty x still gets its step written
    _finite_copy_kernel[(max(triton.cdiv(n, c.BLOCK), 1),)](
        x, out, flag, n, 0.0 if step is None else float(step), HAS_STEP=step is not None,
        BLOCK=c.BLOCK, num_warps=c.NUM_WARPS)
    return out


@triton.jit
def _flag_fill_kernel(
    out_ptr,   # (n,) fp32/fp16/bf16, in place           writes n elements where flagged
    flag_ptr,  # (>= 1,) fp32: NaN everywhere where [0] > 0
    clear_ptr,  # fp32, another tensor: [0] = 0 (program 0) where HAS_CLEAR
    n,
    HAS_CLEAR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if HAS_CLEAR:
        if pid == 0:
            tl.store(clear_ptr, 0.0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    up = tl.load(flag_ptr + tl.zeros((BLOCK,), tl.int32)) > 0  # the flag, in every lane
    nan = tl.full((BLOCK,), float("nan"), tl.float32).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, nan, mask=(offs < n) & up)


def flag_fill(out: torch.Tensor, flag: torch.Tensor, clear: torch.Tensor | None = None
              ) -> torch.Tensor:
    """See :func:`gradcomp.kernels.reference.flag_fill`. Reads nothing of out."""
    check_guard(out, flag, x_name="out")
    if clear is not None:
        check_clear(flag, clear)
    n = out.numel()
    if n or clear is not None:
        _flag_fill_kernel[(max(triton.cdiv(n, c.BLOCK), 1),)](
            out, flag, flag if clear is None else clear, n, HAS_CLEAR=clear is not None,
            BLOCK=c.BLOCK, num_warps=c.NUM_WARPS)
    return out
