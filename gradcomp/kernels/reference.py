"""Pure-torch reference implementations of the quantize and select steps.

These are the specification: every Triton kernel in :mod:`gradcomp.kernels.triton_kernels`
has the same signature and is tested against the function of the same name here. They are
also the production path for CPU tensors.

Conventions shared by all functions:
  * ``x`` is a flat, contiguous float32 tensor (the compressors cast once, up front).
  * Packed bit streams are uint8, least-significant bit first.
  * Byte counts in the comments are for ``n`` float32 elements.
"""
from __future__ import annotations

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
def onebit_compress(x: torch.Tensor, residual: torch.Tensor | None, chunk: int):
    """1-bit quantization with error feedback, in place on ``residual``.

    x: (n,) fp32, n % chunk == 0, chunk % 8 == 0. residual: (n,) fp32 or None (no feedback).
    Computes y = x + residual; sign bit (y >= 0) per element; per chunk the two reconstruction
    values (mean of the non-negative elements, mean of the negative ones, Seide et al. 2014);
    writes residual = y - dequantized(y).
    Returns (bits uint8 (n/8,), scales fp32 (2, n/chunk)).   # reads 2n*4, writes n*4 + n/8
    """
    check_flat(x)
    y = x + residual if residual is not None else x
    yc = y.view(-1, chunk)
    pos = yc >= 0
    npos = pos.sum(dim=1, dtype=torch.int32)  # half the time of the default int64 sum
    nneg = chunk - npos
    psum = yc.clamp_min(0.0).sum(dim=1)  # the same sum as over where(pos, yc, 0)
    nsum = yc.sum(dim=1) - psum
    scales = torch.stack([psum / npos.clamp_min(1), nsum / nneg.clamp_min(1)])
    if residual is not None:
        torch.sub(yc, _dequant(pos, scales[0], scales[1]), out=residual.view(-1, chunk))
    return pack_bits(pos.view(-1)), scales


def _dequant(pos: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """where(pos, high, low) per chunk row: the scales exactly (the decoder's specification;
    a multiply-add would be faster on the CPU but can round the chosen scale)."""
    return torch.where(pos, high.unsqueeze(-1), low.unsqueeze(-1))


def onebit_decompress(bits: torch.Tensor, scales: torch.Tensor, chunk: int, out: torch.Tensor,
                      alpha: float = 1.0) -> torch.Tensor:
    """Accumulate alpha * sum_w dequant(bits[w], scales[w]) into out (n,).

    bits: (W, n/8) uint8, scales: (W, 2, n/chunk). Reads W*(n/8 + 8n/chunk) + 4n, writes 4n.
    """
    pos = unpack_bits(bits).view(bits.shape[0], -1, chunk)
    total = _dequant(pos[0], scales[0, 0], scales[0, 1])
    for w in range(1, pos.shape[0]):
        total += _dequant(pos[w], scales[w, 0], scales[w, 1])
    out.view(-1, chunk).add_(total, alpha=alpha)
    return out


# --------------------------------------------------------------------------- TernGrad
def uniform(seed: int, n: int, device) -> torch.Tensor:
    """n uniforms in [0, 1) from a generator seeded with ``seed`` (reproducible)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.rand(n, generator=g, device=device)


def ternary_compress(x: torch.Tensor, residual: torch.Tensor | None, scale: torch.Tensor,
                     seg: torch.Tensor, seed: int) -> torch.Tensor:
    """Stochastic ternarization (Wen et al. 2017) with error feedback.

    x: (n,) fp32, n % 4 == 0; scale: (S,) fp32 per-segment scaler s >= max|y| of the segment;
    seg: (n,) int segment id of each element; seed: random stream.
    q = sign(y) * Bernoulli(|y| / s) so that E[s q] = y. Codes 0 -> 0, 1 -> +1, 2 -> -1.
    residual (if given) becomes y - s q. Returns packed codes (n/4,) uint8.
    """
    check_flat(x)
    y = x + residual if residual is not None else x
    s = scale if scale.numel() == 1 else scale[seg]  # one layer: no gather
    keep = uniform(seed, y.numel(), y.device).mul_(s) < y.abs()
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
