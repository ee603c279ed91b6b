"""Pure-torch reference implementations of the quantize and select steps.

These are the specification: every Triton kernel in :mod:`gradcomp.kernels.triton` (one module per method)
has the same signature and is tested against the function of the same name here. They are
also the production path for CPU tensors.

Conventions shared by all functions:
  * ``x`` is a flat, contiguous float32 tensor (the compressors cast once, up front).
  * Packed bit streams are uint8, least-significant bit first.
  * Byte counts in the comments are for ``n`` float32 elements.
"""
from __future__ import annotations

import math

import numpy
import torch

def check_flat(x: torch.Tensor, name: str = "x") -> None:
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"{name} must be a flat contiguous tensor, got shape {tuple(x.shape)} "
                         f"with strides {x.stride()}; call .contiguous().view(-1) first")


# --------------------------------------------------------------------------- bit packing
# Packing by one multiply per word: with b_i in {0, 1} the bytes of a little-endian int64
# v = sum b_i 2^(8i), v * PACK8 puts b_i at bit 56 + i and every other product either above
# bit 63 (dropped) or at a distinct position below bit 56 (no carries), so the top byte is
# sum b_i 2^i. The same for four 2-bit codes in an int32 with PACK4 (top byte sum c_i 4^i).
PACK8 = 0x0102040810204080
PACK4 = (1 << 24) | (1 << 18) | (1 << 12) | (1 << 6)
_UNPACK: dict = {}


def _words(t: torch.Tensor, dtype) -> torch.Tensor | None:
    """t's bytes as words of ``dtype`` when t is contiguous and aligned for it, else None."""
    size = torch.empty(0, dtype=dtype).element_size()
    if t.is_contiguous() and t.numel() % size == 0 and (t.storage_offset() * t.element_size()) % size == 0:
        return t.view(torch.uint8).view(dtype)
    return None


def reciprocal(W: int) -> float:
    """1 / W rounded to float32: what CUDA's ``t.div_(W)`` multiplies a float tensor by (a
    division by a number runs as a product by its reciprocal there, not on the CPU)."""
    return float(numpy.float32(1.0) / numpy.float32(W))


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor of n elements (n % 8 == 0) into n/8 bytes. Reads n, writes n/8."""
    w = _words(bits, torch.int64)
    if w is not None:
        return ((w * PACK8) >> 56).to(torch.uint8)  # int64 wraps; the cast keeps the low byte
    b = bits.reshape(-1, 8).to(torch.uint8)
    out = b[:, 0].clone()
    for i in range(1, 8):
        out |= b[:, i] << i
    return out


def _unpack_table(device, bits: int) -> torch.Tensor:
    """int64 per byte value: its 8 bits (or 4 2-bit codes, as int32) spread one per byte."""
    key = (str(device), bits)
    t = _UNPACK.get(key)
    if t is None:
        v = torch.arange(256, dtype=torch.int64)
        if bits == 1:
            t = sum(((v >> i) & 1) << (8 * i) for i in range(8))
        else:
            t = sum(((v >> (2 * i)) & 3) << (8 * i) for i in range(4)).to(torch.int32)
        t = _UNPACK[key] = t.to(device)
    return t


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: n/8 bytes -> n bools (one table lookup per byte)."""
    words = _unpack_table(packed.device, 1)[packed.long()]
    return words.view(torch.uint8).view(*packed.shape[:-1], -1).view(torch.bool)


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in {0,1,2,3} (n % 4 == 0) four to a byte. Reads n, writes n/4."""
    w = _words(codes, torch.int32)
    if w is not None:
        return ((w * PACK4) >> 24).to(torch.uint8)
    c = codes.reshape(-1, 4)
    out = c[:, 0].clone()
    for i in range(1, 4):
        out |= c[:, i] << (2 * i)
    return out


def unpack_2bit(packed: torch.Tensor) -> torch.Tensor:
    words = _unpack_table(packed.device, 2)[packed.long()]
    return words.view(torch.uint8).view(*packed.shape[:-1], -1)


# --------------------------------------------------------------------------- 1-bit SGD
def row_sums(t: torch.Tensor) -> torch.Tensor:
    """The sum of each row of t (..., w), added in one fixed order: the row's second half
    added onto its first, element by element (the middle element of an odd width kept as it
    is), until one element is left.

    The 1-bit scales' specification. A sum in this order is only elementwise adds, which
    every path computes alike (this function, :mod:`.cpu`'s blocks, Inductor's fused loop in
    :mod:`.compiled`), so a chunk's scales are the same bits whatever the number of rows
    around it, the threads or the vector width. ``torch.sum`` orders its additions by the
    shape and the threads (a tensor of one row is split among the threads), Inductor by its
    vector width: the paths differed in the last bit, and since the dispatcher picks the
    path by the bucket's size, a parameter's result depended on its bucket neighbours.
    Reads ~w, writes ~w per row (log2 w passes over halving widths)."""
    w = t.shape[-1]
    while w > 1:
        h = (w + 1) // 2
        head = t[..., : w - h] + t[..., h:w]
        t = head if 2 * h == w else torch.cat([head, t[..., w - h : h]], dim=-1)
        w = h
    return t[..., 0]


def onebit_compress(x: torch.Tensor, residual: torch.Tensor | None, chunk: int):
    """1-bit quantization with error feedback, in place on ``residual``.

    x: (n,) fp32, n % chunk == 0, chunk % 8 == 0. residual: (n,) fp32 or None (no feedback).
    Computes y = x + residual; sign bit (y >= 0) per element; per chunk the two reconstruction
    values (mean of the non-negative elements, mean of the negative ones, Seide et al. 2014),
    each sum taken over the chunk by :func:`row_sums`; writes residual = y - dequantized(y).
    Returns (bits uint8 (n/8,), scales fp32 (2, n/chunk)).   # reads 2n*4, writes n*4 + n/8
    """
    check_flat(x)
    y = x + residual if residual is not None else x
    yc = y.view(-1, chunk)
    pos = yc >= 0
    npos = pos.sum(dim=1, dtype=torch.int32)  # exact in any order; half the time of int64
    nneg = chunk - npos
    # the same sums as over where(pos, yc, 0) and where(pos, 0, yc), up to a zero's sign
    psum = row_sums(yc.clamp_min(0.0))
    nsum = row_sums(yc.clamp_max(0.0))
    scales = torch.stack([psum / npos.clamp_min(1), nsum / nneg.clamp_min(1)])
    if residual is not None:
        torch.sub(yc, dequant(pos, scales[0], scales[1]), out=residual.view(-1, chunk))
    return pack_bits(pos.view(-1)), scales


def dequant(pos: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """where(pos, high, low) per chunk row: the scales exactly (the decoder's specification;
    a multiply-add would be faster on the CPU but can round the chosen scale)."""
    return torch.where(pos, high.unsqueeze(-1), low.unsqueeze(-1))


def onebit_decompress(bits: torch.Tensor, scales: torch.Tensor, chunk: int, out: torch.Tensor,
                      alpha: float = 1.0) -> torch.Tensor:
    """Accumulate alpha * sum_w dequant(bits[w], scales[w]) into out (n,).

    bits: (W, n/8) uint8, scales: (W, 2, n/chunk). Reads W*(n/8 + 8n/chunk) + 4n, writes 4n.
    """
    pos = unpack_bits(bits).view(bits.shape[0], -1, chunk)
    total = dequant(pos[0], scales[0, 0], scales[0, 1])
    for w in range(1, pos.shape[0]):
        total += dequant(pos[w], scales[w, 0], scales[w, 1])
    out.view(-1, chunk).add_(total, alpha=alpha)
    return out


# The GPU's path of 1-bit SGD's two-phase exchange (compressors/onebit.py): three steps that
# read and write the bucket in place of the part layout's copies, each one launch whatever
# the number of parameters. A bucket's compressed parameters are cut into "slot chunks":
# chunk c holds the bucket's elements starts[c] .. starts[c] + reals[c] - 1, the rest of its
# ``chunk`` elements padding (zeros: they count as non-negative in the signs, in no mean).
# A message row holds cpr consecutive chunks: the signs of their elements from byte 0 (bit b
# of byte j: element 8j + b is non-negative), zero bytes up to ``scales_at``, then cpr means
# of the non-negative elements and cpr of the negative ones, in ``scale_dtype`` (float32 or
# bfloat16): the layout the wire declares (compressors/onebit.py's PART and OWNED).
def onebit_slots(starts: torch.Tensor, reals: torch.Tensor, chunk: int):
    """(positions (C, chunk) int64 in the bucket, 0 at the padding; real (C, chunk) bool)."""
    col = torch.arange(chunk, device=starts.device)
    real = col < reals.unsqueeze(1)
    return torch.where(real, starts.unsqueeze(1) + col, 0), real


def onebit_field(msg: torch.Tensor, scales_at: int, count: int, dtype) -> torch.Tensor:
    """The scales field of each row of msg (R, nbytes) uint8: (R, count) of ``dtype``, a view."""
    size = torch.empty((), dtype=dtype).element_size()
    return msg[:, scales_at : scales_at + count * size].view(dtype)


def _onebit_quantize(y: torch.Tensor, real: torch.Tensor, dtype):
    """y (C, chunk), 0 at the padding -> (signs (C, chunk), scales (2, C) of ``dtype``, y less
    its dequantized value (by the rounded scale)): :func:`onebit_compress`'s arithmetic, each
    mean over the real elements."""
    pos = y >= 0
    npos = (pos & real).sum(dim=1, dtype=torch.int32)
    nneg = real.sum(dim=1, dtype=torch.int32) - npos
    psum = row_sums(y.clamp_min(0.0))
    nsum = row_sums(y.clamp_max(0.0))
    scales = torch.stack([psum / npos.clamp_min(1), nsum / nneg.clamp_min(1)]).to(dtype)
    return pos, scales, y - dequant(pos, scales[0].float(), scales[1].float())


def _onebit_put(msg: torch.Tensor, pos: torch.Tensor, scales: torch.Tensor, scales_at: int):
    """Rows of msg (R, nbytes) from the signs pos (R * cpr, chunk) and scales (2, R * cpr)."""
    R = msg.shape[0]
    nb = pos.numel() // (8 * R)
    msg[:, :nb] = pack_bits(pos.reshape(-1)).view(R, nb)
    msg[:, nb:scales_at] = 0
    onebit_field(msg, scales_at, scales.numel() // R, scales.dtype).copy_(
        scales.view(2, R, -1).transpose(0, 1).reshape(R, -1))


def _onebit_values(msg: torch.Tensor, cpr: int, chunk: int, scales_at: int, dtype):
    """The decoded values of msg's rows (R, nbytes): (R * cpr, chunk) fp32."""
    R = msg.shape[0]
    pos = unpack_bits(msg[:, : cpr * chunk // 8]).reshape(R * cpr, chunk)
    s = onebit_field(msg, scales_at, 2 * cpr, dtype).float().view(R, 2, cpr)
    s = s.transpose(0, 1).reshape(2, R * cpr)
    return dequant(pos, s[0], s[1])


def onebit_encode(x, residual, res_next, server_next, starts, reals, chunk: int, rank: int,
                  msg, scales_at: int, scale_dtype, rest, dense):
    """Phase 1 (the all-to-all's message) from the bucket x (n,) fp32.

    y = x + residual at the real elements of every slot chunk (residual None: x), 0 at the
    padding; per chunk its signs and two scales, each the mean of the real elements of that
    sign (:func:`row_sums`), rounded to ``scale_dtype``; written into msg (W, nbytes) uint8,
    row j the chunks j * cpr .. (j + 1) * cpr - 1 (cpr = C / W), as the module's comment
    lays out. res_next (n,) = y - the dequantized value at the real elements, 0 at ``rest``
    (the elements of no compressed parameter: int64 positions, the dense parameters'
    first); it may be residual itself. server_next (n,) or None: 0 everywhere but at the real
    elements of row ``rank``'s chunks (phase 2 writes those). dense (m,) fp32 = x at
    rest[:m]. Reads 8n, writes n/8 + 4n (+ 4n (W-1)/W with server_next)."""
    W = msg.shape[0]
    at, real = onebit_slots(starts, reals, chunk)
    y = x[at]
    if residual is not None:
        y = y + residual[at]
    y = torch.where(real, y, 0.0)
    pos, scales, err = _onebit_quantize(y, real, scale_dtype)
    _onebit_put(msg, pos, scales, scales_at)
    if res_next is not None:
        res_next[at[real]] = err[real]
        res_next[rest] = 0.0
    if server_next is not None:
        others = real.view(W, -1, chunk).clone()
        others[rank] = False
        server_next[at.view(W, -1, chunk)[others]] = 0.0
        server_next[rest] = 0.0
    dense.copy_(x[rest[: dense.numel()]])
    return msg


def onebit_reencode(got, server, server_next, starts, reals, chunk: int, msg, scales_at: int,
                    scale_dtype):
    """Phase 2: the average of this rank's part, quantized again, into its message.

    got (W, nbytes): every rank's phase-1 message for this rank's part, the cpr chunks
    ``starts``/``reals`` (the part's own, in the bucket). y = (1/W in fp32) * the sum of the
    W decoded messages (in rank order; -0.0 as +0.0), 0 at the padding, + server at the real
    elements (None: nothing added); quantized as :func:`onebit_encode` into msg (1, nbytes2) (its
    signs and scales; the bytes past the scales are not written); server_next = y - the
    dequantized value at the real elements (it may be server itself)."""
    W, cpr = got.shape[0], starts.numel()
    at, real = onebit_slots(starts, reals, chunk)
    v = _onebit_values(got, cpr, chunk, scales_at, scale_dtype).view(W, cpr, chunk)
    total = v[0].clone()
    for w in range(1, W):
        total += v[w]
    y = torch.where(real, total * (1.0 / W) + 0.0, 0.0)
    if server is not None:
        y = y + torch.where(real, server[at], 0.0)
    pos, scales, err = _onebit_quantize(y, real, scale_dtype)
    _onebit_put(msg, pos, scales, scales_at)
    if server_next is not None:
        server_next[at[real]] = err[real]
    return msg


def onebit_decode(msgs, starts, reals, chunk: int, scales_at: int, scale_dtype, rest, dense,
                  out, verdict=None):
    """Phase 3: every rank's phase-2 message msgs (W, nbytes2), row j the chunks j * cpr ..
    (j + 1) * cpr - 1, into the bucket out (n,): each real element its decoded value (0 + v:
    -0.0 comes out +0.0); out[rest[:m]] = the sum over the rows of dense (W, m) fp32 (in rank
    order) times 1/W rounded to fp32 (:func:`reciprocal`: a GPU's ``div_(W)``), the rest of
    ``rest`` 0. With the guard's ``verdict`` (flag, clear), for slots and rest that name
    every element of out: then as :func:`flag_fill`. Reads n/8 + 4Wm, writes 4n."""
    _onebit_decode_values(msgs, starts, reals, chunk, scales_at, scale_dtype, rest, dense, out)
    return out if verdict is None else flag_fill(out, *verdict)


def _onebit_decode_values(msgs, starts, reals, chunk, scales_at, scale_dtype, rest, dense, out):
    W = msgs.shape[0]
    at, real = onebit_slots(starts, reals, chunk)
    v = _onebit_values(msgs, starts.numel() // W, chunk, scales_at, scale_dtype) + 0.0
    out[at[real]] = v[real]
    m = dense.shape[1]
    total = dense[0].clone()
    for w in range(1, W):
        total += dense[w]
    out[rest[:m]] = total * reciprocal(W)
    out[rest[m:]] = 0.0
    return out


# --------------------------------------------------------------------------- TernGrad
# Philox4x32-10 (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011), as
# Triton's tl.rand draws it (triton/language/random.py): the reference and the kernel draw
# the same uniforms, so a CPU run and a GPU run with the same seeds agree.
_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX: dict = {}


def _philox_consts(device):
    """(round multipliers (2, 1), key increments (2, 1)) as int64 on ``device``, cached."""
    key = str(device)
    hit = _PHILOX.get(key)
    if hit is None:
        hit = _PHILOX[key] = (
            torch.tensor([[PHILOX_ROUND_A], [PHILOX_ROUND_B]], dtype=torch.int64, device=device),
            torch.tensor([[PHILOX_KEY_B], [PHILOX_KEY_A]], dtype=torch.int64, device=device))
    return hit


def philox_uniform(seed, counter: torch.Tensor, word: torch.Tensor | None = None) -> torch.Tensor:
    """``tl.rand(seed, counter)`` for every element of ``counter``, bit for bit; with
    ``word`` (int64 like ``counter``, each in 0..3): that output word of Philox instead of
    the first, as the ``word``-th of ``tl.rand4x(seed, counter)``.

    seed: a python int, or an int64 tensor broadcastable to ``counter`` (a seed per element;
    seeds of 2^63 and above as their two's complement); counter: int64 tensor >= 0.
    Philox4x32-10 with counter words (c mod 2^32, c >> 32, 0, 0) and key (seed mod 2^32,
    seed >> 32); the output word taken as int32, folded to [0, 2^31) (x < 0 -> ~x) and
    scaled by 4.6566127342e-10 in fp32, as ``randint`` then ``uint_to_uniform_float``.

    Vectorized over the elements (a fixed number of ops: 7 per round). The 32-bit halves of
    the products come from int64 products that wrap mod 2^64 (two's complement, as the
    packing above relies on too): the low half is exact, the high half is (p >> 32) masked.
    State: X = (c0, c2), the words the round multiplies; Y the full products of the round
    before, whose low halves are (c3, c1), the words each row of X is xored with.
    """
    counter = counter.to(torch.int64)
    device = counter.device
    mul, key_step = _philox_consts(device)
    if isinstance(seed, torch.Tensor):
        seed = seed.to(torch.int64)
        K = torch.stack([(seed >> 32) & _U32, seed & _U32])  # (k1, k0)
    else:
        seed = int(seed) & _U64
        K = torch.tensor([[seed >> 32], [seed & _U32]], dtype=torch.int64, device=device)
    zero = torch.zeros_like(counter)
    X = torch.stack([counter & _U32, zero])              # (c0, c2)
    Y = torch.stack([zero, counter >> 32])               # (c3, c1)
    for i in range(10):
        P = X * mul                                      # (A c0, B c2), mod 2^64
        Z = P >> 32                                      # its high halves (and sign bits)
        Z ^= Y                                           # ^ (c3, c1): low halves of the last products
        Z ^= K                                           # ^ (k1, k0)
        Z &= _U32                                        # (c2', c0')
        X, Y = Z.flip(0), P                              # (c0', c2'); (c3', c1') in P's low halves
        if i < 9:
            K = K + key_step                             # keys mod 2^32 (high bits masked above)
    if word is None:
        w = X[0]
    else:  # the four output words (c0, c1, c2, c3), one taken per element
        words = torch.stack([X[0], Y[1] & _U32, X[1], Y[0] & _U32])
        w = words.gather(0, word.to(torch.int64).expand_as(counter).unsqueeze(0)).squeeze(0)
    return word_uniform(w)


def word_uniform(w: torch.Tensor) -> torch.Tensor:
    """A Philox output word (int64 holding a uint32) as ``uint_to_uniform_float`` maps it:
    taken as int32, folded to [0, 2^31) (x < 0 -> ~x), times 4.6566127342e-10 in fp32."""
    x = w.to(torch.int32)                                # bitcast of the uint32 word
    x = x ^ (x >> 31)                                    # x < 0 -> ~x
    return x.to(torch.float32).mul_(4.6566127342e-10)


def uniform(seed: int, n: int, device) -> torch.Tensor:
    """n uniforms in [0, 1): ``tl.rand(seed, i)`` for i = 0 .. n-1 (:func:`philox_uniform`)."""
    return philox_uniform(seed, torch.arange(n, dtype=torch.int64, device=device))


def ternary_uniforms(seed, starts: torch.Tensor | None, seg: torch.Tensor, n: int,
                     device) -> torch.Tensor:
    """The uniform each element of :func:`ternary_compress` draws. Element j of a stream
    takes output word j % 4 of Philox at counter j // 4 (``tl.rand4x(seed, j // 4)``): one
    Philox per four elements, all four of its words used. The stream is x itself (j = i)
    when ``seed`` is an int; with ``seed`` an (S,) tensor of per-segment seeds, each segment
    k is its own stream, counted from its first element (j = i - starts[k]), so a segment's
    draws do not depend on where it lies."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    if not isinstance(seed, torch.Tensor):
        return philox_uniform(seed, i >> 2, i & 3)
    if starts is None:
        raise ValueError("per-segment seeds need the segments' starts")
    j = i - starts[seg]
    return philox_uniform(seed[seg], j >> 2, j & 3)


def ternary_compress(x: torch.Tensor, residual: torch.Tensor | None, scale: torch.Tensor,
                     seg: torch.Tensor, seed, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Stochastic ternarization (Wen et al. 2017) with error feedback.

    x: (n,) fp32, n % 4 == 0; scale: (S,) fp32 per-segment scaler s >= max|y| of the segment;
    seg: (n,) int segment id of each element; seed: an int (one random stream over x), or
    an (S,) int64 tensor of per-segment seeds with ``starts`` (S,) int64, the index of each
    segment's first element (see :func:`ternary_uniforms`).
    q = sign(y) * Bernoulli(|y| / s) so that E[s q] = y. Codes 0 -> 0, 1 -> +1, 2 -> -1.
    residual (if given) becomes y - s q. Returns packed codes (n/4,) uint8.
    """
    check_flat(x)
    y = x + residual if residual is not None else x
    s = scale if scale.numel() == 1 else scale[seg]  # one layer: no gather
    keep = ternary_uniforms(seed, starts, seg, y.numel(), y.device).mul_(s) < y.abs()
    neg = y < 0
    codes = neg.to(torch.uint8).add_(1).mul_(keep)  # 0 -> 0, +1 -> 1, -1 -> 2
    if residual is not None:
        q = neg.to(torch.float32).mul_(-2.0).add_(1.0).mul_(keep).mul_(s)  # s * sign * keep
        torch.sub(y, q, out=residual)
    return pack_2bit(codes)


def ternary_decompress(packed: torch.Tensor, scale: torch.Tensor, seg: torch.Tensor,
                       out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Accumulate alpha * sum_w s[w] * q[w] into out. packed (W, n/4), scale (W, S)."""
    codes = unpack_2bit(packed)[:, : out.numel()]
    sign = (codes == 1).float() - (codes == 2).float()
    s = scale if scale.shape[1] == 1 else scale[:, seg]  # one layer: no gather
    out.add_((sign * s).sum(dim=0), alpha=alpha)
    return out


BASE3 = (1, 3, 9, 27, 81)  # a ternary code's weight in a byte, by its place among five


def pack_base3(codes: torch.Tensor) -> torch.Tensor:
    """Codes in {0, 1, 2} (n,) five to a byte in base 3: byte = c0 + 3 c1 + 9 c2 + 27 c3 +
    81 c4, the first value in c0, the last byte's missing values 0 ((n + 4) // 5 bytes)."""
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, -codes.numel() % 5)).view(-1, 5)
    return (c * torch.tensor(BASE3, dtype=torch.uint8, device=codes.device)).sum(
        1, dtype=torch.uint8)


def unpack_base3(b: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`pack_base3`'s inverse per row: (..., bytes) -> (..., n) codes."""
    powers = torch.tensor(BASE3, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-1) // powers) % 3).reshape(*b.shape[:-1], -1)[..., :n]


# Elements per chunk of TernGrad's statistics on a GPU (one program each, then one per
# segment over its chunks): 256 KiB of fp32, so that a layer of a few million elements
# spreads over the SMs of a GPU (an H100 has 132) and GPT-2's 38.6M-element embedding
# over 590 programs. Not tuned by measurement.
STATS_CHUNK = 65536  # a power of two


def stats_chunks(numel: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments of ``numel`` elements cut into chunks of :data:`STATS_CHUNK` (an empty
    segment: one empty chunk): ((C,) int32 each chunk's segment, (S + 1,) int64 each
    segment's first chunk, then C). Made once per layout."""
    counts = [max(1, -(-m // STATS_CHUNK)) for m in numel]  # (read at call time: tests set it)
    first = [0]
    for n in counts:
        first.append(first[-1] + n)
    cseg = torch.repeat_interleave(torch.arange(len(numel), dtype=torch.int32),
                                   torch.tensor(counts, dtype=torch.int64))
    return cseg.to(device), torch.tensor(first, dtype=torch.int64, device=device)


def ternary_stats(x: torch.Tensor, xoff: torch.Tensor, numel: torch.Tensor,
                  lengths: torch.Tensor, clip: float,
                  chunks: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """TernGrad's per-segment statistics, read from x where each segment lies.

    Segment k is x[xoff[k] : xoff[k] + numel[k]] followed by lengths[k] - numel[k] zeros
    (its padding); with its sum, sum of squares and max |y| over those lengths[k] values,
    bound = clip * sqrt(max(sumsq / L - (sum / L)^2, 0)) (L = lengths[k]) and
    scale = min(max |y|, bound) (max |y| alone when ``clip`` is 0): the scaler of y clipped
    to [-bound, bound]. Returns (scale, bound), (S,) fp32 each. The sums are fp32 in an
    order of the implementation's choosing (here float64, rounded once): implementations
    agree to within a few roundings on the bound; max |y| is exact. ``chunks``
    (:func:`stats_chunks`): how an implementation may cut the segments, unread here.
    Reads 4n, writes 8S."""
    S = xoff.numel()
    scale = torch.zeros(S, dtype=torch.float32, device=x.device)
    bound = torch.zeros(S, dtype=torch.float32, device=x.device)
    for k in range(S):
        a, m, L = int(xoff[k]), int(numel[k]), int(lengths[k])
        y = x[a : a + m].double()
        top = y.abs().max() if m else y.new_zeros(())
        mean = y.sum() / L
        b = (y.square().sum() / L - mean * mean).clamp_min(0).sqrt() * clip
        bound[k] = b
        scale[k] = torch.minimum(top, b) if clip else top
    return scale, bound


def ternary_encode(src: torch.Tensor, soff: torch.Tensor, snum: torch.Tensor,
                   scale: torch.Tensor, bound: torch.Tensor | None, seg: torch.Tensor,
                   seeds: torch.Tensor, starts: torch.Tensor, out: torch.Tensor,
                   x: torch.Tensor | None = None, dense_pos: torch.Tensor | None = None,
                   dense_out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`ternary_compress` with per-segment seeds (no residual), read from where each
    segment lies and written five codes a byte; with ``dense_pos`` ((D,) int64) also
    dense_out (D,) fp32 = x[dense_pos] (the values sent as they are).

    seg: (npad,) the segment of each element of the padded layout (npad % 4 == 0); element
    i of segment k (j = i - starts[k]) is src[soff[k] + j] where j < snum[k], else 0, and
    with ``bound`` clamped to [-bound[k], bound[k]]; its code is :func:`ternary_compress`'s
    (seed seeds[k], counter j). out: ((npad + 4) // 5,) uint8 = :func:`pack_base3` of the
    codes. Reads 4 npad (+ 4 npad of seg) + 12 D, writes npad / 5 + 4 D."""
    n = seg.numel()
    k = seg.long()
    j = torch.arange(n, dtype=torch.int64, device=seg.device) - starts[k]
    inside = j < snum[k]
    y = torch.where(inside, src[torch.where(inside, soff[k] + j, 0)].float(), 0.0)
    if bound is not None:
        y = torch.minimum(torch.maximum(y, -bound[k]), bound[k])
    codes = unpack_2bit(ternary_compress(y, None, scale, seg, seeds, starts))
    if dense_pos is not None:
        dense_out.copy_(x[dense_pos])
    return out.copy_(pack_base3(codes))


def ternary_decode(codes: torch.Tensor, scales: torch.Tensor, dense: torch.Tensor | None,
                   xseg: torch.Tensor, xoff: torch.Tensor, src: torch.Tensor, S: int,
                   out: torch.Tensor, alpha: float, verdict=None) -> torch.Tensor:
    """Every rank's TernGrad message decoded into x's layout (``out``, written, not read).

    codes: (W, >= (npad + 4) // 5) uint8 base-3 codes (:func:`ternary_encode`); scales:
    (W, S) fp32; dense: (W, D) fp32 values sent as they are. xseg: (n,) int32 the entry of
    each element of out (-1: none); entry k lies at out[xoff[k]:], a compressed segment
    (k < S) whose codes start at src[k], or a dense one (k >= S) whose values start at
    dense[:, src[k]]. out[i] of a compressed segment is alpha * sum_w s[w, k] q[w] (the sum
    from 0 in rank order, as 0 + v: -0.0 comes out +0.0), of a dense one the sum over ranks
    (from rank 0's value, in rank order) divided by W, of none 0. Reads W npad / 5 (+ 4 n
    of xseg), writes n. With the guard's ``verdict`` (flag, clear): then as
    :func:`flag_fill` (out is written whole)."""
    _ternary_decode_values(codes, scales, dense, xseg, xoff, src, S, out, alpha)
    return out if verdict is None else flag_fill(out, *verdict)


def _ternary_decode_values(codes, scales, dense, xseg, xoff, src, S, out, alpha):
    W, n = codes.shape[0], out.numel()
    k = xseg.long()
    i = torch.arange(n, dtype=torch.int64, device=out.device)
    comp, dn = (k >= 0) & (k < S), k >= S
    kk = k.clamp_min(0)
    at = src[kk] + i - xoff[kk]
    e = torch.where(comp, at, 0)
    digit = torch.tensor(BASE3, dtype=torch.int32, device=out.device)[e % 5]
    acc = torch.zeros(n, dtype=torch.float32, device=out.device)
    for w in range(W):
        c = (codes[w][e // 5].to(torch.int32) // digit) % 3
        s = scales[w][kk.clamp_max(max(S - 1, 0))] if S else acc
        acc += torch.where(c == 1, s, torch.where(c == 2, -s, 0.0))
    v = acc * alpha
    v = torch.where(v == 0, 0.0, v)
    if dense is not None and dense.shape[1]:
        d = torch.where(dn, at, 0)
        total = dense[0][d].clone()
        for w in range(1, W):
            total += dense[w][d]
        v = torch.where(dn, total / W, v)
    out.copy_(torch.where(comp | dn, v, 0.0))
    return out


# --------------------------------------------------------------------------- top-k select
def sample_threshold(x: torch.Tensor, k: int, sample: torch.Tensor) -> torch.Tensor:
    """Estimate the magnitude of the k-th largest |x| from a random sample (no full sort, and
    no pass over x: only the sampled elements are read).

    x: (n,) values; sample: int64 indices into x. Returns a 0-d tensor t such that about k
    elements have |x| >= t.
    """
    s = x[sample].abs()
    ks = max(1, min(s.numel(), -(-k * s.numel() // x.numel())))
    return torch.topk(s, ks, sorted=False).values.min()


def select_topk(x: torch.Tensor, threshold: torch.Tensor, k: int, capacity: int):
    """Select k elements of largest magnitude among those with |x| >= threshold.

    The first ``capacity`` (>= k) candidates in index order are compacted into a buffer, then an
    exact top-k runs over that small buffer: if the sampled threshold let through too many, the
    correction is bounded by ``capacity``; if too few passed, the unused slots carry value 0 and
    index 0, which add nothing when scattered. No host synchronization.
    Returns (values fp32 (k,), indices int32 (k,)).
    """
    n = x.numel()
    mask = x.abs() >= threshold
    if x.device.type == "cpu":
        # On the CPU the candidate count costs no device sync: nonzero gives the same first
        # `capacity` candidates in index order, without the cumsum and scatters below.
        cand_idx = torch.nonzero(mask).view(-1)[:capacity]
        cand_val = torch.zeros(capacity, dtype=x.dtype)
        cand_val[: cand_idx.numel()] = x[cand_idx]
        cand_idx = torch.cat([cand_idx, cand_idx.new_zeros(capacity - cand_idx.numel())])
        top = torch.topk(cand_val.abs(), k, sorted=False).indices
        vals = cand_val[top]
        return vals, torch.where(vals != 0, cand_idx[top], 0).to(torch.int32)
    pos = torch.cumsum(mask, 0, dtype=torch.int64) - 1
    keep = mask & (pos < capacity)
    slot = torch.where(keep, pos, capacity)  # dropped elements land in a spill slot
    cand_idx = torch.zeros(capacity + 1, dtype=torch.int64, device=x.device)
    cand_idx.scatter_(0, slot, torch.arange(n, device=x.device))
    cand_val = torch.zeros(capacity + 1, dtype=x.dtype, device=x.device)
    cand_val.scatter_(0, slot, torch.where(keep, x, 0.0))
    cand_val, cand_idx = cand_val[:capacity], cand_idx[:capacity]
    top = torch.topk(cand_val.abs(), k, sorted=False).indices
    vals = cand_val[top]
    idx = torch.where(vals != 0, cand_idx[top], 0)
    return vals, idx.to(torch.int32)


def scatter_add(values: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
                alpha: float = 1.0) -> torch.Tensor:
    """out[indices] += alpha * values, duplicates accumulate. values/indices: any shape."""
    out.index_add_(0, indices.reshape(-1).long(), values.reshape(-1), alpha=alpha)
    return out


# --------------------------------------------------------------------------- threshold quantization
# The steps of compressors/threshold.py that follow the segmented sample and select, one
# value per parameter (P), per segment (S) or per code slot (K).
def threshold_sample(x: torch.Tensor, e: torch.Tensor | None, y: torch.Tensor | None,
                     base: torch.Tensor, of: torch.Tensor, shifts: torch.Tensor, n: torch.Tensor,
                     off: torch.Tensor, key: torch.Tensor, tail: torch.Tensor):
    """Error feedback's y = x + e into ``y`` (with ``e``; else y is x), then every
    parameter's sampled magnitudes of y and their sort keys: (keys (M + 2,) int64,
    mag (M + 2,) fp32). Sample j is |y| at ``(base[j] + shifts[of[j]]) mod n[j] + off[j]``
    (its Weyl point shifted, modulo its parameter's size, at its offset); the two constants
    ``tail`` (NaN, 0) close mag. keys = key - the bits of mag (``key``: (segment << 31) +
    0x7FFFFFFF per sample: ascending keys order by segment, then magnitude descending)."""
    if e is not None:
        x = torch.add(x, e, out=y)
    at = (base + shifts[of]).remainder_(n).add_(off)
    mag = torch.cat([x[at].abs_(), tail])
    return key - mag.view(torch.int32).to(torch.int64), mag


def threshold_tau(keys: torch.Tensor, order: torch.Tensor, mag: torch.Tensor,
                  zero_key: torch.Tensor, est_start: torch.Tensor, est_end: torch.Tensor,
                  taus: torch.Tensor | None, where: torch.Tensor, seg_thr: torch.Tensor,
                  seg_param: torch.Tensor, param_seg: torch.Tensor, fixed: float, ema: float,
                  out: torch.Tensor | None = None):
    """Each parameter's tau and each segment's selection threshold: (sent_tau (P,), thr (S,));
    sent_tau into ``out`` (P,) fp32 where given.
    ``keys``, ``order``: :func:`threshold_sample`'s keys sorted and the sort's permutation;
    ``mag``: its magnitudes, unsorted (sorted: mag[order]). A segment's sampled threshold is
    guard[s] = sorted mag[seg_thr[s]] (NaN for a gap, 0 where ks is 0).

    Adaptive (``taus`` given: the memory of every parameter of the bucket, 0 = no estimate
    yet; updated in place at ``where``): with nonzero_end = searchsorted(keys, zero_key)
    (zeros sort last within a parameter), est = sorted mag[min(est_end, nonzero_end) - 1],
    +inf where nonzero_end <= est_start (no non-zero sample); tau = est at the first
    estimate, the previous tau where est is +inf, else lerp(prev, est, 1 - ema). Fixed
    (``taus`` None): tau = ``fixed``. sent_tau = tau, 0 where +inf (nothing sent). thr[s] =
    guard[s] for a gap (NaN), max(guard[s], nextafter(tau, +inf)) for parameter p's segment
    s = param_seg[p] (|y| > tau <=> |y| >= nextafter(tau)); seg_param: (S,) each segment's
    parameter (any for a gap: its NaN wins)."""
    P = est_start.numel()
    mag = mag[order]
    guard = mag[seg_thr]
    if taus is not None:
        nonzero_end = torch.searchsorted(keys, zero_key)
        est = mag[torch.minimum(est_end, nonzero_end) - 1]
        est.masked_fill_(nonzero_end <= est_start, math.inf)  # every sampled |y| is 0
        prev = taus[where]
        tau = torch.where(prev == 0, est, torch.where(
            torch.isinf(est), prev, torch.lerp(prev, est, 1 - ema)))
    else:
        tau = torch.full((P,), fixed, dtype=torch.float32, device=guard.device)
    sent = torch.where(torch.isinf(tau), 0.0, tau)
    if taus is not None:
        taus.index_copy_(0, where, sent)
    thr = torch.maximum(guard, torch.nextafter(tau, torch.full_like(tau, math.inf))[seg_param])
    return (sent if out is None else out.copy_(sent)), thr


def threshold_encode(vals: torch.Tensor, idx: torch.Tensor, owner: torch.Tensor,
                     tau: torch.Tensor, residual: torch.Tensor | None, x: torch.Tensor,
                     dense: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """The message's codes and dense values, into ``words`` (K + P + D,) int32 (the message:
    K codes, P taus, D dense values as fp32 bits; ``tau`` may be its taus): codes[k] =
    sign(vals) * (idx + 1), 0 for an unused slot (value 0); the dense values x[dense]. With a
    residual (n,), which holds what vals were selected from: residual less
    sign(vals) * tau[owner] at idx, in place (what is not sent), and 0 at ``dense`` (the
    elements sent exactly keep no error). Returns the codes (a view of words)."""
    K, P = vals.numel(), tau.numel()
    sign = torch.sign(vals)
    codes = words[:K]
    codes.copy_((idx + 1).to(torch.int32).mul_(sign.to(torch.int32)))
    words[K + P : K + P + dense.numel()].copy_(x[dense].view(torch.int32))
    if residual is not None:
        residual.index_put_((idx,), -sign * tau[owner], accumulate=True)
        residual.index_fill_(0, dense, 0.0)
    return codes


def threshold_decode(got: torch.Tensor, K: int, P: int, owner: torch.Tensor,
                     out: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """out += every row's elements: got (W, >= K + P + D) int32 rows of K codes, P taus
    (fp32 bits), D dense values (fp32 bits); code c != 0 adds sign(c) * tau[owner[slot]] at
    |c| - 1; out[dense] = the sum of the rows' dense values, in rank order (``dense``: (D,)
    positions no code reaches). Returns out."""
    codes = got[:, :K]
    taus = got[:, K : K + P].contiguous().view(torch.float32)
    scatter_add(torch.sign(codes).float() * taus[:, owner], codes.abs().sub_(1).clamp_(min=0), out)
    rows = got[:, K + P : K + P + dense.numel()].contiguous().view(torch.float32)
    if dense.numel():
        total = rows[0].clone()
        for r in rows[1:]:
            total += r
        out.index_copy_(0, dense, total)
    return out


# --------------------------------------------------------------------------- top-k's message
# compressors/topk.py's exchange_sparse (top-k, DGC): the message's fields written in one pass,
# every rank's read in one.
def sparse_encode(wire: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor,
                  residual: torch.Tensor | None, x: torch.Tensor, dense: torch.Tensor,
                  out_idx: torch.Tensor, out_wire: torch.Tensor, out_dense: torch.Tensor,
                  pad: torch.Tensor) -> None:
    """The message's fields: out_idx (k,) int32 = idx, out_wire (k,) = wire (the values as
    they travel), out_dense (D,) = x[dense], pad (the zero bytes before the dense values) = 0.
    With a residual (n,) (error feedback's y): residual less vals (the values as they
    arrive, fp32; a padding slot, value 0 at index 0, changes nothing) at idx, in place, and
    0 at ``dense`` (the elements sent exactly keep no error)."""
    out_idx.copy_(idx)
    out_wire.copy_(wire)
    torch.index_select(x, 0, dense, out=out_dense)
    pad.zero_()
    if residual is not None:
        residual.index_add_(0, idx, vals, alpha=-1)
        residual.index_fill_(0, dense, 0.0)


def sparse_decode(got: torch.Tensor, k: int, vals_at: int, dtype: torch.dtype, dense_at: int,
                  out: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """out += every row's values at its indices, out[dense] = the sum of the rows' dense
    values in rank order. got: (W, nbytes) uint8 messages: k int32 indices at byte 0, k values
    of ``dtype`` at byte ``vals_at``, D = dense.numel() fp32 values at byte ``dense_at``
    (``dense``: their positions, which no index of a sent value reaches; a padding slot's
    index is 0 with the value 0, which leaves any sum as it is but a -0.0 at element 0).
    Returns out."""
    def field(at, n, dt):
        size = torch.empty((), dtype=dt).element_size()
        return got[:, at : at + n * size].contiguous().view(dt)

    vals = field(vals_at, k, dtype)
    scatter_add(vals.float() if dtype != torch.float32 else vals, field(0, k, torch.int32), out)
    if dense.numel():
        rows = field(dense_at, dense.numel(), torch.float32)
        total = rows[0].clone()
        for r in rows[1:]:
            total += r
        out.index_copy_(0, dense, total)
    return out


# --------------------------------------------------------------------------- inf/NaN guard
def check_guard(x: torch.Tensor, flag: torch.Tensor, out: torch.Tensor | None = None,
                x_name: str = "x", flag_len: int = 1) -> None:
    """The guard's kernels' inputs (every backend checks them so): ``x`` flat and contiguous,
    ``flag`` fp32 with at least ``flag_len`` elements, ``out`` (if given) flat, of x's size
    and dtype."""
    check_flat(x, x_name)
    if out is not None:
        check_flat(out, "out")
        if out.dtype != x.dtype or out.numel() != x.numel():
            raise ValueError(f"out must be x's size and dtype ({x.numel()} {x.dtype}), got "
                             f"{out.numel()} {out.dtype}")
    if flag.dtype != torch.float32 or flag.numel() < flag_len:
        raise ValueError(f"flag must be fp32 with at least {flag_len} element"
                         f"{'s' if flag_len > 1 else ''}, got {flag.dtype} with {flag.numel()}")


def check_clear(flag: torch.Tensor, clear: torch.Tensor) -> None:
    """flag_fill's ``clear``: fp32, at least one element, not flag's memory (its [0] is read
    by every lane while clear's is zeroed)."""
    if clear.dtype != torch.float32 or clear.numel() < 1:
        raise ValueError(f"clear must be fp32 with at least one element, got {clear.dtype} "
                         f"with {clear.numel()}")
    if clear.data_ptr() == flag.data_ptr():
        raise ValueError("clear must be another tensor than flag (flag[0] is read while "
                         "clear[0] is zeroed)")


def finite_copy(x: torch.Tensor, flag: torch.Tensor, out: torch.Tensor | None = None,
                step: float | None = None) -> torch.Tensor:
    """x with every NaN, +inf and -inf put to 0 (a new tensor, x's dtype, or written into
    ``out``: a flat tensor of x's size and dtype, x itself for in place), and flag[0] = 1
    where x held any of them (left as it is otherwise). With ``step`` (a float, exact in
    fp32), flag[1] = step and flag[2] = -step as well: the guard's whole flag written by the
    one kernel, no copy from the host. x: flat contiguous, fp32/fp16/bf16; flag: fp32, at
    least one element (three with ``step``). Reads n, writes n (+ the flag)."""
    check_guard(x, flag, out, flag_len=1 if step is None else 3)
    bad = torch.isfinite(x).all().logical_not()
    flag[:1].masked_fill_(bad.reshape(1), 1.0)
    if step is not None:
        flag[1].fill_(step)  # made where flag lies: nothing goes up from the host
        flag[2].fill_(-step)
    if out is None:
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0, out=out)


def flag_fill(out: torch.Tensor, flag: torch.Tensor, clear: torch.Tensor | None = None
              ) -> torch.Tensor:
    """out filled with NaN, in place, where flag[0] > 0 (left as it is otherwise): the
    guard's verdict on a bucket, decided on the device. With ``clear`` (fp32, another
    tensor than flag), clear[0] = 0 as well: the guard's next flag made ready by the same
    kernel. Reads 1 (+ n where set), writes n (+ 1)."""
    check_guard(out, flag, x_name="out")
    if clear is not None:
        check_clear(flag, clear)
    out.masked_fill_(flag[:1] > 0, float("nan"))
    if clear is not None:
        clear[:1] = 0.0
    return out
