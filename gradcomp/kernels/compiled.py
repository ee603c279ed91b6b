"""The 1-bit and TernGrad encoders as fused CPU loops: the reference's arithmetic in plain
torch, fused by ``torch.compile`` (Inductor's C++ backend) into one loop nest per step.

1-bit: **bit-identical** to the reference. Its per-chunk sums are
:func:`reference.row_sums`, a fixed order of elementwise adds that Inductor keeps as written
(it vectorizes a ``sum`` in its own order, which made the scales of earlier versions differ
from the reference in the last bit; the dispatcher picks this path by the bucket's size, so
a parameter's result then depended on its bucket neighbours). The signs come from
``y = x + residual``, one add, the same everywhere. Tested bit for bit
(``tests/test_compiled.py``).

TernGrad: **bit-identical** to the reference. Its Philox stream is integer arithmetic (the
32-bit halves of each round's products taken from int64 products, as the reference does),
its comparison ``u * s < |y|`` one rounding, its residual ``y - s q`` one subtraction of an
exact product: nothing Inductor can reorder. The reference's Philox in torch ops makes ~70
passes over (2, n) int64 tensors; fused, the stream costs one pass (measured 18x less time
at 11M elements, bench/RESULTS.md section 6). The loop runs over groups of four elements,
one code byte each: one Philox per group, its four words the group's four uniforms (the
stream's definition, :func:`reference.ternary_uniforms`), and the byte packed in the loop.
Tested bit for bit.

The 1-bit encoder: y = x + residual into the residual (one eager add), then three passes
over y: the statistics, compiled (each chunk's two scales: its three sums in one loop), the
signs packed eagerly block by block (:func:`cpu.pack_signs`: Inductor's CPU code stores bools
and bytes an element at a time, 42 of an earlier fused encoder's 62 ms at 11M elements), the
residual's update in place, compiled. At 11M elements on one thread (a loaded machine) the
statistics took 13.5 ms with the eager add against 14.8 ms for the earlier fused pass of
``torch.sum``'s.

Each 1-bit step is compiled once per process and chunk size, on first use, with dynamic
sizes (a new bucket size does not recompile); the chunk is a constant of the generated code,
and ``alpha`` goes in as a tensor so its value is not guarded. The TernGrad encoder is
compiled once per process (twice with and without a residual) with every size dynamic.
Inductor's on-disk FX graph cache makes a later process's compile fast (bench/RESULTS.md,
section 6). Where compiling fails (no C++ compiler), one warning, and the steps run
:mod:`.cpu` (1-bit) or the reference (TernGrad) from then on. Inputs that are not fp32, CPU
and contiguous, or smaller than ``MIN_NUMEL``, run those too.

The 1-bit decoder: one loop over the elements, each chunk's element k reading bit k % 8 of
its byte, bit-identical to :mod:`.cpu`'s blocked decoder (the messages added in the same
order); 23 -> 7 ms for one message of 11M elements on one thread, 40 -> 11 for two
(bench/RESULTS.md section 6, "The 1-bit decoder in one loop"). Compiled once per chunk
size and message count.
"""
from __future__ import annotations

import functools
import shutil
import warnings

import torch

from . import cpu, reference
from .reference import PHILOX_KEY_A, PHILOX_KEY_B, PHILOX_ROUND_A, PHILOX_ROUND_B, check_flat

# cpu.py's threshold: from 2^17 elements up the compiled steps took no more CPU time than the
# blocked ones (bench/compiled_codec.py, bench/RESULTS.md section 6); below it, not measured
MIN_NUMEL = 1 << 17
# the steps the dispatcher sends here (each bit-identical to the path it replaces: the
# dispatcher picks by a bucket's size, so any difference would tie a parameter's result to
# its bucket neighbours)
STEPS = ("onebit_compress", "onebit_decompress", "ternary_compress", "ternary_decompress")

_failed: str | None = None  # why compiling failed, once it has


def _stats(y: torch.Tensor, chunk: int) -> torch.Tensor:
    """The scales of reference.onebit_compress on a (C, chunk) view of y = x + residual:
    each chunk's two means, (2, C). Every sum is :func:`reference.row_sums`' fixed order
    (elementwise adds, which Inductor does not reorder), the count of non-negative elements
    too (exact in any order), so the three fuse into one loop over y and the scales are the
    reference's bits."""
    npos = reference.row_sums((y >= 0).to(torch.float32))  # exact: counts <= 2^24
    psum = reference.row_sums(y.clamp_min(0.0))
    nsum = reference.row_sums(y.clamp_max(0.0))
    return torch.stack([psum / npos.clamp_min(1), nsum / (chunk - npos).clamp_min(1)])


def _feedback(y: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """y (C, chunk) -= its dequantized value: hi where y >= 0, else lo (the new residual)."""
    return y.sub_(torch.where(y >= 0, scales[0].unsqueeze(1), scales[1].unsqueeze(1)))


def _onebit_terms(bits: torch.Tensor, scales: torch.Tensor, chunk: int) -> torch.Tensor:
    """The sum over the W messages of reference.onebit_decompress's values, (C, chunk), from
    (W, C, chunk / 8) bits and (W, 2, C) scales, written to fuse into one loop over the
    elements: element k of a chunk reads bit k % 8 of its byte k // 8 (each byte broadcast
    over its eight elements, so the loads stay direct and the loop vectorizes; as one
    unpack of (W, C, chunk / 8, 8) bools and a ``where`` it ran no faster than :mod:`.cpu`,
    and with per-element computed indices 4x slower), selects hi or lo as the reference's
    ``where`` does, and adds the messages in the reference's order (w = 0, 1, ...; the sum
    starts from 0: 0 + t turns -0.0 into +0.0). The same bits as :mod:`.cpu`'s decoder."""
    W, C = bits.shape[0], bits.shape[1]
    shift = torch.arange(chunk, dtype=torch.int32, device=bits.device) & 7
    total = None
    for w in range(W):  # W is static: the messages unroll
        b = bits[w].unsqueeze(-1).expand(C, chunk // 8, 8).reshape(C, chunk).to(torch.int32)
        t = torch.where((b >> shift) & 1 == 1, scales[w, 0].unsqueeze(-1),
                        scales[w, 1].unsqueeze(-1))
        total = t + 0.0 if total is None else total + t
    return total


def _onebit_put(bits: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                alpha: torch.Tensor, chunk: int) -> torch.Tensor:
    """out (C, chunk) = what ``cpu.put_decoded`` gives without accumulating (alpha * total +
    0.0), in the same loop: no total buffer, out not read."""
    return out.copy_(_onebit_terms(bits, scales, chunk) * alpha + 0.0)


_U32 = 0xFFFFFFFF


def _philox4(seed: torch.Tensor, counter: torch.Tensor):
    """reference.philox_uniform's rounds written element-wise (one int64 tensor per Philox
    word), so the ten rounds fuse into one loop: the same integer arithmetic, the same bits.
    Returns the four output words (c0, c1, c2, c3)."""
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    c0, c1 = counter & _U32, (counter >> 32) & _U32
    c2 = c3 = torch.zeros_like(counter)
    for i in range(10):
        p0 = c0 * PHILOX_ROUND_A  # mod 2^64: the low half exact, the high half masked
        p1 = c2 * PHILOX_ROUND_B
        c0, c1, c2, c3 = (((p1 >> 32) & _U32) ^ c1 ^ k0, p1 & _U32,
                          ((p0 >> 32) & _U32) ^ c3 ^ k1, p0 & _U32)
        if i < 9:
            k0, k1 = (k0 + PHILOX_KEY_A) & _U32, (k1 + PHILOX_KEY_B) & _U32
    return c0, c1, c2, c3


def _ternary(x, residual, scale, seg, seed, starts):
    """reference.ternary_compress with per-segment seeds whose segments start at multiples
    of 4, written to fuse: one loop over groups of four elements (one code byte each) draws
    one Philox per group, whose four words are the group's four uniforms, decides the four
    codes and packs them into the byte. Returns (bytes (n/4,) uint8, and with a residual
    its four columns y - s q, (n/4,) each, which the caller interleaves)."""
    x4 = x.view(-1, 4)
    r4 = residual.view(-1, 4) if residual is not None else None
    sg = seg.view(-1, 4)[:, 0].long()  # a group's segment (segments start at multiples of 4)
    s = scale[sg]
    ctr = torch.arange(x4.shape[0], dtype=torch.int64, device=x.device) - (starts[sg] >> 2)
    words = _philox4(seed[sg], ctr)
    byte, cols = None, []
    for k in range(4):
        y = x4[:, k] + r4[:, k] if r4 is not None else x4[:, k]
        keep = reference.word_uniform(words[k]) * s < y.abs()
        neg = y < 0
        code = (neg.to(torch.int32) + 1) * keep.to(torch.int32)  # 0, 1 (+s), 2 (-s)
        byte = code if byte is None else byte | (code << (2 * k))
        if r4 is not None:
            cols.append(y - torch.where(keep, torch.where(neg, -s, s), 0.0))
    return (byte.to(torch.uint8), *cols)


def _ternary_terms(packed, scale, seg, W: int):
    """sum_w s[w] * q[w] of reference.ternary_decompress, written to fuse, its sum over the W
    messages unrolled in the reference's order (w = 0, 1, ...): one loop over the elements,
    element j reading bits 2 (j % 4) of byte j // 4 of each message (as one loop over bytes
    with four columns it ran 1.1-1.6x slower: Inductor stored the columns and interleaved
    them in a second loop)."""
    j = torch.arange(seg.numel(), dtype=torch.int64, device=seg.device)
    byte, shift = j >> 2, ((j & 3) * 2).to(torch.int32)
    sg = seg.long()
    total = None
    for w in range(W):
        c = (packed[w][byte].to(torch.int32) >> shift) & 3
        t = ((c == 1).to(torch.float32) - (c == 2).to(torch.float32)) * scale[w][sg]
        # the reference's sum over messages starts from 0: 0 + t turns -0.0 into +0.0
        total = t + 0.0 if total is None else total + t
    return total


def _ternary_put(packed, scale, seg, out, alpha, W: int):
    """out = what ``cpu.put_decoded`` gives without accumulating (alpha * total + 0.0, -0.0
    to +0.0 as a zero out's add does), written into out in the same loop: no separate
    passes for the scaling and the + 0.0, no total buffer. Returns out (None is _run's
    failure)."""
    return out.copy_(_ternary_terms(packed, scale, seg, W) * alpha + 0.0)


_INLINE = {"realize_opcount_threshold": 1 << 20, "realize_reads_threshold": 1 << 20}


@functools.cache
def _compiled(step: str, chunk: int):
    """``step`` compiled: "ternary" once, "ternary_terms" and "ternary_put" once per message
    count (``chunk`` stands for W there), every size dynamic; the 1-bit steps once per chunk
    size (below)."""
    if step == "ternary":
        # the four words feed four columns: kept inline (not stored as n/4 int64 buffers
        # each, and the loop left scalar, as Inductor's defaults chose: 3x slower)
        return torch.compile(_ternary, fullgraph=True, dynamic=True, options=_INLINE)
    if step in ("ternary_terms", "ternary_put"):
        fn = _ternary_terms if step == "ternary_terms" else _ternary_put
        return torch.compile(functools.partial(fn, W=chunk), fullgraph=True, dynamic=True)
    return _compiled_onebit(step, chunk)


def _compiled_onebit(step: str, chunk: int):
    """``step`` compiled for one chunk size: a closure constant, so a constant of the generated
    code (the chunk loop vectorizes); the sizes marked dynamic at each call are symbolic."""
    if step == "stats":
        def fn(y):
            return _stats(y, chunk)
    elif step == "feedback":
        return torch.compile(_feedback, fullgraph=True)
    elif step == "onebit_terms":  # compiled again per message count W (a static size)
        def fn(bits, scales):
            return _onebit_terms(bits, scales, chunk)
    else:
        def fn(bits, scales, out, alpha):
            return _onebit_put(bits, scales, out, alpha, chunk)
    return torch.compile(fn, fullgraph=True)


def _fail(reason: str) -> None:
    """Turn the compiled path off for this process, with the one warning that says why."""
    global _failed
    _failed = reason
    warnings.warn(f"gradcomp: the compiled CPU path is off ({reason}); running the "
                  "pure-torch CPU path (gradcomp/kernels/cpu.py, reference.py) instead",
                  RuntimeWarning, stacklevel=4)


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


# the 1-bit steps' dims marked dynamic, per argument: chunks (C), messages (W)
_DYNAMIC = {"stats": ((0,),),                         # y (C, chunk)
            "feedback": ((0,), (1,)),                 # y (C, chunk), scales (2, C)
            # bits (W, C, chunk/8), scales (W, 2, C), out (C, chunk), alpha; W stays static
            "onebit_put": ((1,), (2,), (0,), ()),
            "onebit_terms": ((1,), (2,))}


def _run(step: str, chunk: int, *args):
    """The compiled step's result, or None (after one warning) if it cannot be compiled. The
    tensors' leading dims (chunks, messages) are marked dynamic: one compile serves all sizes."""
    if compiler_missing() is None:
        for t, dims in zip(args, _DYNAMIC.get(step, ())):  # TernGrad's: dynamic=True
            if t is not None:
                for d in dims:
                    if t.shape[d] > 1:  # sizes 0 and 1 are always specialized
                        torch._dynamo.mark_dynamic(t, d)
        try:
            return _compiled(step, chunk)(*args)
        except Exception as e:  # noqa: BLE001  (a compile failure of any kind: fall back)
            _fail(f"torch.compile failed: {type(e).__name__}: {e}")
    return None


def onebit_compress(x: torch.Tensor, residual: torch.Tensor | None, chunk: int):
    """:func:`reference.onebit_compress`, fused. Same arguments, the same bits."""
    check_flat(x)
    n = x.numel()
    if (takes(x) and n % chunk == 0 and chunk % 8 == 0
            and (residual is None or (takes(residual) and residual.numel() == n))):
        C = n // chunk
        y = x if residual is None else residual.add_(x)  # x + r == r + x exactly
        scales = _run("stats", chunk, y.view(C, chunk))
        if scales is None:  # no compiler (one warning): the same sums eagerly, y added once
            scales = _stats(y.view(C, chunk), chunk)
        bits = cpu.pack_signs(y)
        if residual is not None and _run("feedback", chunk, y.view(C, chunk), scales) is None:
            _feedback(y.view(C, chunk), scales)  # the same arithmetic, eager
        return bits, scales
    return cpu.onebit_compress(x, residual, chunk)


def onebit_decompress(bits: torch.Tensor, scales: torch.Tensor, chunk: int, out: torch.Tensor,
                      alpha: float = 1.0, accumulate: bool = True) -> torch.Tensor:
    """:func:`cpu.onebit_decompress`, fused: the same arguments, the same bits (the messages'
    sum in one loop, the accumulation into ``out`` cpu's own ``put_decoded``).
    ``accumulate=False``: out is not read, the result is that of a zero out."""
    n = out.numel()
    if (takes(out) and n % chunk == 0 and chunk % 8 == 0 and bits.dim() == 2
            and bits.shape[0] > 0 and bits.shape[1] * 8 == n
            and bits.dtype == torch.uint8 and bits.is_contiguous()
            and scales.dtype == torch.float32 and scales.is_contiguous()
            and tuple(scales.shape) == (bits.shape[0], 2, n // chunk)):
        W, C = bits.shape[0], n // chunk
        b3 = bits.view(W, C, chunk // 8)
        if not accumulate:
            a = torch.tensor(alpha, dtype=torch.float32)
            if _run("onebit_put", chunk, b3, scales, out.view(C, chunk), a) is not None:
                return out
        else:
            total = _run("onebit_terms", chunk, b3, scales)
            if total is not None:
                cpu.put_decoded(out, total.view(-1), alpha, accumulate)
                return out
    return cpu.onebit_decompress(bits, scales, chunk, out, alpha, accumulate)


def ternary_compress(x: torch.Tensor, residual: torch.Tensor | None, scale: torch.Tensor,
                     seg: torch.Tensor, seed, starts: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`reference.ternary_compress`, fused. Same arguments, the same bits; per-segment
    seeds (a tensor, with ``starts``) whose segments start at multiples of 4 (TernGrad's
    padded layout) only: others run the reference."""
    check_flat(x)
    if (takes(x) and isinstance(seed, torch.Tensor) and starts is not None
            and (residual is None or (takes(residual) and residual.numel() == x.numel()))
            and scale.dtype == torch.float32 and seg.numel() == x.numel()
            and x.numel() % 4 == 0 and not bool((starts & 3).any())):
        got = _run("ternary", 0, x, residual, scale, seg, seed.to(torch.int64), starts)
        if got is not None:
            if residual is not None:  # the columns y - s q, interleaved back
                torch.stack(got[1:], dim=1, out=residual.view(-1, 4))
            return got[0]
    return reference.ternary_compress(x, residual, scale, seg, seed, starts)


def ternary_decompress(packed: torch.Tensor, scale: torch.Tensor, seg: torch.Tensor,
                       out: torch.Tensor, alpha: float = 1.0, accumulate: bool = True
                       ) -> torch.Tensor:
    """:func:`reference.ternary_decompress`: the sum over messages fused, the accumulation
    into ``out`` the reference's own ``add_`` (its alpha arithmetic): the same bits.
    ``accumulate=False``: out is not read, the result is that of a zero out (cpu.put_decoded)."""
    W, n = packed.shape[0], out.numel()
    if (takes(out) and W > 0 and n % 4 == 0 and packed.dtype == torch.uint8
            and packed.is_contiguous() and packed.shape[1] * 4 >= n
            and scale.dtype == torch.float32 and seg.numel() == n):
        if not accumulate:
            a = torch.tensor(alpha, dtype=torch.float32)
            if _run("ternary_put", W, packed[:, : n // 4], scale, seg, out, a) is not None:
                return out
        else:
            total = _run("ternary_terms", W, packed[:, : n // 4], scale, seg)
            if total is not None:
                cpu.put_decoded(out, total, alpha, accumulate)
                return out
    return cpu.ternary_decompress(packed, scale, seg, out, alpha, accumulate)
