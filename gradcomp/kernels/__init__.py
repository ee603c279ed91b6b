"""Quantize and select steps, dispatched by device.

CPU tensors run pure torch: the 1-bit steps and TernGrad's decoder through :mod:`.cpu` (the
reference's arithmetic block by block, bit-identical to it), everything else through the
reference (:mod:`.reference`), which is the specification. On large fp32 tensors the 1-bit
and TernGrad steps run :mod:`.compiled` instead (fused by ``torch.compile``, bit-identical to
the reference) where a C++ compiler is present; without one it warns once and runs
:mod:`.cpu` or the reference. Every CPU path gives the same bits: the choice goes by a
bucket's size, and a parameter's result must not depend on the bucket around it. CUDA
tensors run the Triton kernels (at every size) when Triton is importable; Triton is
imported lazily so the package imports without it.

``GRADCOMP_KERNELS`` picks: ``auto`` (the default, as above), ``cpu`` (the bit-identical
pure-torch CPU path, never compiling: what the test suite runs unless a test asks),
``reference`` (the reference everywhere), or ``triton`` (with ``TRITON_INTERPRET=1`` for CPU
tensors, the kernels on every tensor: how the tests drive the compressors' GPU path on a CPU).
A run resumes bit-exactly from a checkpoint on any CPU path, and on the GPU on the Triton
path (the Triton kernels sum in their own order: a CPU run and a GPU run differ in the last
bits of the 1-bit scales).
"""
from __future__ import annotations

import functools
import os

import torch

from . import compiled, cpu, reference
from .reference import (  # noqa: F401  (re-exported helpers with no kernel of their own)
    check_flat, pack_2bit, pack_bits, philox_uniform, sample_threshold, unpack_2bit, unpack_bits,
    uniform,
)

_triton = None


def _triton_kernels():
    """The Triton kernels (kernels/triton/), imported on first use; False without Triton."""
    global _triton
    if _triton is None:
        try:
            from . import triton as kernels
            _triton = kernels
        except ImportError:
            _triton = False
    return _triton


def backend(name: str, t: torch.Tensor) -> str:
    """Which implementation of step ``name`` runs for tensors like ``t``: "triton",
    "compiled", "cpu" or "reference". The one decision: every step's dispatch
    (:func:`implementation`) and every choice of algorithm made for a backend (PowerSGD's
    table of matrices, the segmented top-k's compaction) asks it."""
    mode = os.environ.get("GRADCOMP_KERNELS", "auto")
    if mode != "reference" and (t.device.type == "cuda" or mode == "triton") and _triton_kernels():
        return "triton"
    if mode == "auto" and name in compiled.STEPS and compiled.takes(t):
        return "compiled"
    blocked = t.device.type == "cpu" and mode in ("auto", "cpu") and hasattr(cpu, name)
    return "cpu" if blocked else "reference"


def implementation(name: str, t: torch.Tensor, which: str | None = None, reference_fn=None):
    """The function that runs step ``name`` for tensors like ``t``: from the module of
    ``which`` (default: :func:`backend`'s choice). The reference is :mod:`.reference`'s
    function of that name, or ``reference_fn`` for a step specified elsewhere (PowerSGD's
    matrix steps, in :mod:`.lowrank`)."""
    which = which or backend(name, t)
    if which == "reference":
        return reference_fn or getattr(reference, name)
    module = {"triton": _triton_kernels, "compiled": lambda: compiled, "cpu": lambda: cpu}[which]()
    return getattr(module, name)


def finite_copy(x, flag, out=None, step=None):
    """x with NaN and +-inf put to 0 (a new tensor, or into ``out``: x itself for in
    place); flag[0] = 1 where x held any; with ``step``, flag[1:3] = (step, -step)."""
    return implementation("finite_copy", x)(x, flag, out, step)


def flag_fill(out, flag, clear=None):
    """out = NaN, in place, where flag[0] > 0; with ``clear``, clear[0] = 0."""
    return implementation("flag_fill", out)(out, flag, clear)


def onebit_compress(x, residual, chunk):
    return implementation("onebit_compress", x)(x, residual, chunk)


def _decoder(name: str, out: torch.Tensor, accumulate: bool):
    """The decoder ``name`` for ``out``, taking the decoders' arguments. With
    ``accumulate=False`` its result is what a zero-filled out would get, bit for bit (0 + v:
    -0.0 comes out +0.0): :mod:`.cpu`'s, :mod:`.compiled`'s and the Triton decoders write
    it without reading out (no launch to zero it on a GPU); the reference gets out zeroed
    first."""
    which = backend(name, out)
    fn = implementation(name, out, which)
    if which in ("cpu", "compiled", "triton"):
        return functools.partial(fn, accumulate=accumulate)
    if not accumulate:
        out.zero_()
    return fn


def onebit_decompress(bits, scales, chunk, out, alpha=1.0, accumulate=True):
    """out += alpha * the sum of the decoded messages (out = that, accumulate=False)."""
    return _decoder("onebit_decompress", out, accumulate)(bits, scales, chunk, out, alpha)


def onebit_encode(x, residual, res_next, server_next, starts, reals, chunk, rank, msg, scales_at,
                  scale_dtype, rest, dense):
    """1-bit SGD's phase 1 from the bucket into the all-to-all's message (reference.py)."""
    return implementation("onebit_encode", x)(x, residual, res_next, server_next, starts, reals,
                                              chunk, rank, msg, scales_at, scale_dtype, rest, dense)


def onebit_reencode(got, server, server_next, starts, reals, chunk, msg, scales_at, scale_dtype):
    """1-bit SGD's phase 2: this rank's part averaged and quantized again (reference.py)."""
    return implementation("onebit_reencode", got)(got, server, server_next, starts, reals, chunk,
                                                  msg, scales_at, scale_dtype)


def onebit_decode(msgs, starts, reals, chunk, scales_at, scale_dtype, rest, dense, out,
                  verdict=None):
    """1-bit SGD's phase 3: every rank's part into the bucket (reference.py)."""
    return implementation("onebit_decode", out)(msgs, starts, reals, chunk, scales_at,
                                                scale_dtype, rest, dense, out, verdict)


def ternary_compress(x, residual, scale, seg, seed, starts=None):
    return implementation("ternary_compress", x)(x, residual, scale, seg, seed, starts)


def ternary_decompress(packed, scale, seg, out, alpha=1.0, accumulate=True):
    """out += alpha * the sum of the decoded messages (out = that, accumulate=False)."""
    return _decoder("ternary_decompress", out, accumulate)(packed, scale, seg, out, alpha)


def select_topk(x, threshold, k, capacity):
    return implementation("select_topk", x)(x, threshold, k, capacity)


def scatter_add(values, indices, out, alpha=1.0):
    return implementation("scatter_add", out)(values, indices, out, alpha)


def sparse_encode(wire, vals, idx, residual, x, dense, out_idx, out_wire, out_dense, pad):
    return implementation("sparse_encode", x)(wire, vals, idx, residual, x, dense, out_idx,
                                              out_wire, out_dense, pad)


def sparse_decode(got, k, vals_at, dtype, dense_at, out, dense):
    return implementation("sparse_decode", out)(got, k, vals_at, dtype, dense_at, out, dense)


def threshold_sample(x, e, y, base, of, shifts, n, off, key, tail):
    return implementation("threshold_sample", x)(x, e, y, base, of, shifts, n, off, key, tail)


def threshold_tau(keys, order, mag, zero_key, est_start, est_end, taus, where, seg_thr,
                  seg_param, param_seg, fixed, ema, out=None):
    return implementation("threshold_tau", mag)(keys, order, mag, zero_key, est_start, est_end,
                                                taus, where, seg_thr, seg_param, param_seg,
                                                fixed, ema, out)


def threshold_encode(vals, idx, owner, tau, residual, x, dense, words):
    return implementation("threshold_encode", x)(vals, idx, owner, tau, residual, x, dense, words)


def threshold_decode(got, K, P, owner, out, dense):
    return implementation("threshold_decode", out)(got, K, P, owner, out, dense)
