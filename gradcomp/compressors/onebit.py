"""1-bit SGD (Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014).

Each element is sent as its sign bit (packed 8 per byte); each chunk of ``chunk`` elements
also sends two fp32 reconstruction values, the mean of its non-negative and of its negative
elements. Quantization error is fed back into the next step.

Exchange: an error-compensated two-phase reduce (as in 1-bit Adam, Tang et al. 2021), so the
bytes each rank sends do not grow with the world size W. Each parameter is padded to whole
chunks and cut into W equal parts; rank j owns part j of every parameter (so ownership, and
with it the second error memory, never depends on the bucket layout):
  1. y = g + e1; quantize y; all-to-all: rank j receives every rank's part j.
                                                           (sends (W-1)/W * n/8 bytes)
  2. Rank j decodes and averages its parts, adds its own second error memory e2, quantizes
     again (e2 keeps that error) and allgathers them, with the values of the parameters
     below ``min_numel`` elements, which go dense.         (sends n/(8W) bytes to each peer)
  3. Every rank decodes all W parts: the average.
About n/4 bytes (+ scales) per rank per step against 8n(W-1)/W for a ring fp32 allreduce:
a 16x..32x saving at any W.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..config import MethodConfig, check
from .base import Compressor, dense_values, put_dense, register_method


@dataclass(frozen=True)
class OneBitConfig(MethodConfig):
    """chunk: elements sharing one pair of reconstruction values (a multiple of 8)."""

    chunk: int = 256

    def validate(self):
        check(self.chunk >= 8 and self.chunk % 8 == 0, "chunk", self.chunk,
              "a positive multiple of 8")


def encode(y: torch.Tensor, residual, chunk: int) -> torch.Tensor:
    """One uint8 message: packed signs followed by the scales' bytes."""
    bits, scales = kernels.onebit_compress(y, residual, chunk)
    return torch.cat([bits, scales.reshape(-1).view(torch.uint8)])


def decode_sum(msgs: torch.Tensor, chunk: int, out: torch.Tensor, alpha: float) -> torch.Tensor:
    """out += alpha * sum of the decoded messages msgs (R, bytes) of out.numel() elements each."""
    nb = out.numel() // 8
    scales = msgs[:, nb:].contiguous().view(torch.float32).view(msgs.shape[0], 2, -1)
    return kernels.onebit_decompress(msgs[:, :nb].contiguous(), scales, chunk, out, alpha)


@register_method
class OneBit(Compressor):
    Config = OneBitConfig
    name = "onebit"
    residual_slot = "residual"
    description = "1-bit SGD: sign bits + 2 scales per chunk, error feedback, two-phase reduce"

    def __init__(self, config):
        super().__init__(config)
        self._layouts = {}  # part layout per (bucket layout, W)

    def reduce(self, x, ctx):
        big, dense = self.split(ctx.params)
        if not big:
            return self.dense(x, ctx)
        cfg, W, r = self.config, ctx.comm.world_size, ctx.comm.rank
        chunk = cfg.chunk
        pieces, part = self._part_layout(big, W, chunk)
        ef = cfg.error_feedback
        y = _spread(x, pieces, W, part)
        res = _spread(ctx.memory("residual"), pieces, W, part) if ef else None
        msg = self._encode_parts(y, res, W, part, chunk)
        if ef:
            _gather(res, ctx.memory("residual"), pieces, W, part)
        got = ctx.comm.all_to_all(msg)  # (W, part_bytes): every rank's message for my part
        mine = torch.zeros(part, dtype=torch.float32, device=x.device)
        decode_sum(got, chunk, mine, 1.0 / W)
        res2 = e2p = None
        if ef:  # the second memory holds, per parameter, what this rank owns (its part)
            e2p = _spread(ctx.memory("server_residual"), pieces, W, part)
            res2 = e2p[r]
        msg2 = torch.cat([encode(mine, res2, chunk),
                          dense_values(x, dense).view(torch.uint8)])
        if ef:
            _gather(e2p, ctx.memory("server_residual"), pieces, W, part, rows=[r])
        allmsg = ctx.comm.allgather(msg2)  # (W, part_bytes + dense bytes)
        nb, ns = part // 8, 2 * (part // chunk) * 4
        # the W parts laid end to end are one message of W * part elements
        bits = allmsg[:, :nb].reshape(1, -1)
        scales = allmsg[:, nb : nb + ns].contiguous().view(torch.float32).view(W, 2, -1)
        scales = scales.transpose(0, 1).reshape(1, 2, -1)
        out = torch.zeros(W * part, dtype=torch.float32, device=x.device)
        kernels.onebit_decompress(bits, scales, chunk, out)
        result = torch.empty_like(x)
        _gather(out.view(W, part), result, pieces, W, part)
        put_dense(allmsg[:, nb + ns :], dense, result)
        return result

    @staticmethod
    def _encode_parts(y, res, W, part, chunk):
        """Quantize y (W, part) once; lay the message out as W rows, one per destination."""
        bits, scales = kernels.onebit_compress(y.view(-1), None if res is None else res.view(-1), chunk)
        bits = bits.view(W, part // 8)
        scales = scales.view(2, W, part // chunk).transpose(0, 1).reshape(W, -1)
        return torch.cat([bits, scales.contiguous().view(torch.uint8)], dim=1)

    def _part_layout(self, params, W, chunk):
        """([(offset in x, numel, column in a part, width)] per parameter, part length): each
        parameter is padded to W * width elements, width a whole number of chunks."""
        key = (tuple((p.name, p.offset, p.numel) for p in params), W, chunk)
        hit = self._layouts.get(key)
        if hit is None:
            pieces, col = [], 0
            for p in params:
                width = -(-p.numel // (W * chunk)) * chunk
                pieces.append((p.offset, p.numel, col, width))
                col += width
            hit = self._layouts[key] = (pieces, col)
        return hit


def _spread(src, pieces, W, part):
    """(W, part) zero-padded: row j holds part j of every parameter of the flat ``src``."""
    dst = torch.empty(W, part, dtype=torch.float32, device=src.device)
    for off, n, col, width in pieces:
        block = dst[:, col : col + width]
        q, rem = divmod(n, width)
        block[:q].copy_(src[off : off + q * width].view(q, width))
        if rem:
            block[q, :rem].copy_(src[off + q * width : off + n])
            block[q, rem:].zero_()
        block[q + (rem > 0):].zero_()  # only the padding is zeroed, not the whole buffer
    return dst


def _gather(src, dst, pieces, W, part, rows=None):
    """Inverse of :func:`_spread` into the flat ``dst``; only the given rows when ``rows``."""
    for off, n, col, width in pieces:
        for j in (rows if rows is not None else range(W)):
            lo, hi = min(n, j * width), min(n, (j + 1) * width)
            if hi > lo:
                dst[off + lo : off + hi].copy_(src[j, col : col + hi - lo])
