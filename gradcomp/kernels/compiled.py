"""The 1-bit steps as fused CPU loops: the reference's arithmetic in plain torch, fused by
``torch.compile`` (Inductor's C++ backend) into one loop nest per step.

A separate backend, not a faster copy of the reference: Inductor vectorizes the per-chunk
sums, which changes their order, so the scales (and the residual and decoded values built
from them) can differ from :mod:`.reference` in the last bit or two. The signs cannot: they
are taken from ``y = x + residual``, one add, the same in both, so the bits are equal.
Results are deterministic on one machine (the same generated code runs every time), so a
run resumes bit-exactly as long as it stays on this path; a run that switches between this
path and the reference or :mod:`.cpu` mid-way changes in the last bits. Tested against the
reference within one or two ulps (``tests/test_compiled.py``).

Each step is compiled once per process and chunk size, on first use, with dynamic sizes
(a new bucket size does not recompile); the chunk is a constant of the generated code, and
``alpha`` goes in as a tensor so its value is not guarded. Inductor's on-disk FX graph
cache makes a later process's compile fast (bench/RESULTS.md, section 6). Where compiling
fails (no C++ compiler), one warning, and the steps run :mod:`.cpu` from then on.
Inputs that are not fp32, CPU and contiguous, or smaller than ``MIN_NUMEL``, run :mod:`.cpu`.
The dispatcher sends only the encoder here (``STEPS``): the fused decoder is built and tested
but was measured no faster than :mod:`.cpu`'s.
"""
from __future__ import annotations

import functools
import shutil
import warnings

import torch

from . import cpu
from .reference import check_flat

# cpu.py's threshold: from 2^17 elements up the compiled steps took no more CPU time than the
# blocked ones (bench/compiled_onebit.py, bench/RESULTS.md section 6); below it, not measured
MIN_NUMEL = 1 << 17
# the steps the dispatcher sends here: the fused decoder measured no faster than cpu.py's
# (within this machine's noise, RESULTS.md section 6), so decoding stays bit-identical
STEPS = ("onebit_compress",)

_failed: str | None = None  # why compiling failed, once it has


def _encode(x: torch.Tensor, residual: torch.Tensor | None, chunk: int):
    """reference.onebit_compress on (C, chunk) views, written to fuse: one pass computes y, the
    two sums and the positive count per chunk; a second the bits and the new residual."""
    y = x + residual if residual is not None else x
    pos = y >= 0
    npos = pos.sum(dim=1, dtype=torch.int32)
    psum = y.clamp_min(0.0).sum(dim=1)
    nsum = y.sum(dim=1) - psum
    hi = psum / npos.clamp_min(1)
    lo = nsum / (chunk - npos).clamp_min(1)
    weights = 1 << torch.arange(8, dtype=torch.int32, device=x.device)  # LSB first
    bits = (pos.view(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)
    if residual is not None:
        residual.copy_(y - torch.where(pos, hi.unsqueeze(1), lo.unsqueeze(1)))
    return bits, torch.stack([hi, lo])


def _decode(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, alpha: torch.Tensor,
            chunk: int) -> torch.Tensor:
    """reference.onebit_decompress on (W, C, chunk / 8) bits and a (C, chunk) out, written to
    fuse: unpack, select and sum the W messages and accumulate into out in one loop."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    pos = ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(bits.shape[0], -1, chunk)
    total = torch.where(pos, scales[:, 0].unsqueeze(-1), scales[:, 1].unsqueeze(-1)).sum(dim=0)
    return out.add_(total * alpha)


@functools.cache
def _compiled(step: str, chunk: int):
    """``step`` compiled for one chunk size: a closure constant, so a constant of the generated
    code (the chunk loop vectorizes); the sizes marked dynamic at each call are symbolic."""
    if step == "encode":
        def fn(x, residual):
            return _encode(x, residual, chunk)
    else:
        def fn(bits, scales, out, alpha):
            return _decode(bits, scales, out, alpha, chunk)
    return torch.compile(fn, fullgraph=True)


def _fail(reason: str) -> None:
    """Turn the compiled path off for this process, with the one warning that says why."""
    global _failed
    _failed = reason
    warnings.warn(f"gradcomp: the compiled 1-bit path is off ({reason}); running the "
                  "pure-torch CPU path (gradcomp/kernels/cpu.py) instead", RuntimeWarning,
                  stacklevel=4)


def compiler_missing() -> str | None:
    """Why this process cannot compile (no C++ compiler, or a compile that failed), or None."""
    if _failed is None:
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler
            cxx = get_cpp_compiler()
        except Exception as e:  # noqa: BLE001  (any failure to find one means: none)
            _fail(f"no C++ compiler for Inductor: {e}")
        else:
            if shutil.which(cxx) is None:
                _fail(f"no C++ compiler for Inductor: {cxx!r} not found")
    return _failed


def takes(t: torch.Tensor) -> bool:
    """Whether the compiled path runs for tensors like ``t``."""
    return (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            and t.numel() >= MIN_NUMEL and compiler_missing() is None)


def _run(step: str, chunk: int, *args):
    """The compiled step's result, or None (after one warning) if it cannot be compiled. The
    tensors' leading dims (chunks, messages) are marked dynamic: one compile serves all sizes."""
    if compiler_missing() is None:
        for t in args:
            if t is not None and t.dim() > 1:  # (C, chunk), (W, C, chunk/8), (W, 2, C)
                dims = (0,) if t.dim() == 2 else (0, 2 if t.dtype == torch.float32 else 1)
                for d in dims:
                    if t.shape[d] > 1:  # sizes 0 and 1 are always specialized
                        torch._dynamo.mark_dynamic(t, d)
        try:
            return _compiled(step, chunk)(*args)
        except Exception as e:  # noqa: BLE001  (a compile failure of any kind: fall back)
            _fail(f"torch.compile failed: {type(e).__name__}: {e}")
    return None


def onebit_compress(x: torch.Tensor, residual: torch.Tensor | None, chunk: int):
    """:func:`reference.onebit_compress`, fused. Same arguments; results within an ulp or
    two (bits equal)."""
    check_flat(x)
    n = x.numel()
    if (takes(x) and n % chunk == 0 and chunk % 8 == 0
            and (residual is None or (takes(residual) and residual.numel() == n))):
        C = n // chunk
        got = _run("encode", chunk, x.view(C, chunk),
                   None if residual is None else residual.view(C, chunk))
        if got is not None:
            return got
    return cpu.onebit_compress(x, residual, chunk)


def onebit_decompress(bits: torch.Tensor, scales: torch.Tensor, chunk: int, out: torch.Tensor,
                      alpha: float = 1.0) -> torch.Tensor:
    """:func:`reference.onebit_decompress`, fused. Same arguments; results within an ulp or
    two."""
    n = out.numel()
    if (takes(out) and n % chunk == 0 and chunk % 8 == 0 and bits.shape[0] > 0
            and bits.dtype == torch.uint8 and bits.is_contiguous()
            and scales.dtype == torch.float32 and scales.is_contiguous()):
        a = torch.tensor(alpha, dtype=torch.float32)
        W, C = bits.shape[0], n // chunk
        if _run("decode", chunk, bits.view(W, C, chunk // 8), scales, out.view(C, chunk),
                a) is not None:
            return out
    return cpu.onebit_decompress(bits, scales, chunk, out, alpha)
