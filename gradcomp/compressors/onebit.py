"""1-bit SGD (Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014).

Each element is sent as its sign bit (packed 8 per byte); each chunk of ``chunk`` elements
also sends two fp32 reconstruction values, the mean of its non-negative and of its negative
elements. Quantization error is fed back into the next step.

Exchange: an error-compensated two-phase reduce (as in 1-bit Adam, Tang et al. 2021), so the
bytes each rank sends do not grow with the world size W:
  1. y = g + e1; quantize y; split the message into W parts; all-to-all: rank j receives
     every rank's part j.                                  (sends (W-1)/W * n/8 bytes)
  2. Rank j decodes and averages its part, adds its own second error memory e2, quantizes
     again (e2 keeps that error) and allgathers its part.  (sends n/(8W) bytes to each peer)
  3. Every rank decodes all W parts: the average.
About n/4 bytes (+ scales) per rank per step against 8n(W-1)/W for a ring fp32 allreduce:
a 16x..32x saving at any W.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..config import MethodConfig, check
from .base import Compressor, register_method


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

    def __init__(self, config):
        super().__init__(config)
        self._layouts = {}  # padded-layout index per bucket layout
    name = "onebit"
    description = "1-bit SGD: sign bits + 2 scales per chunk, error feedback, two-phase reduce"

    def reduce(self, x, ctx):
        if self.small(x):
            return self.dense(x, ctx)
        cfg, W, r = self.config, ctx.comm.world_size, ctx.comm.rank
        chunk = cfg.chunk
        # Each parameter starts a new chunk (padded layout), so no chunk mixes a parameter
        # with its neighbours: one scale pair per chunk of ONE tensor, as Seide's per-column.
        pieces, npad = self._padded_layout(ctx, chunk)
        part = -(-npad // (W * chunk)) * chunk  # elements per rank's part, whole chunks
        lo, hi = r * part, (r + 1) * part
        ef = cfg.error_feedback
        e1 = ctx.memory("residual") if ef else None
        e2 = ctx.memory("server_residual") if ef else None
        if ef and ctx.relayout and W > 1:
            # parts moved with the new layout: fold the second memory into the first, which
            # keeps the total (e1 counts 1/W towards the average, e2 counts fully)
            e1.add_(e2, alpha=W)
            e2.zero_()
        y = torch.zeros(W * part, dtype=torch.float32, device=x.device)
        _spread(x, y, pieces)
        res = None
        if ef:
            res = torch.zeros_like(y)
            _spread(e1, res, pieces)
        msg = self._encode_parts(y, res, W, part, chunk)
        if ef:
            _gather(res, e1, pieces)
        got = ctx.comm.all_to_all(msg)  # (W, part_bytes): every rank's message for my part
        mine = torch.zeros(part, dtype=torch.float32, device=x.device)
        decode_sum(got, chunk, mine, 1.0 / W)
        res2 = None
        if ef:
            e2p = torch.zeros(W * part, dtype=torch.float32, device=x.device)
            _spread(e2, e2p, pieces)
            res2 = e2p[lo:hi]
        msg2 = encode(mine, res2, chunk)
        if ef:
            _gather(e2p, e2, pieces)
        allmsg = ctx.comm.allgather(msg2)  # (W, part_bytes)
        # the W parts laid end to end are one message of W * part elements
        nb = part // 8
        bits = allmsg[:, :nb].reshape(1, -1)
        scales = allmsg[:, nb:].contiguous().view(torch.float32).view(W, 2, -1)
        scales = scales.transpose(0, 1).reshape(1, 2, -1)
        out = torch.zeros(W * part, dtype=torch.float32, device=x.device)
        kernels.onebit_decompress(bits, scales, chunk, out)
        _gather(out, x, pieces)
        return x

    @staticmethod
    def _encode_parts(y, res, W, part, chunk):
        """Quantize y once; lay the message out as W rows, one per destination part."""
        bits, scales = kernels.onebit_compress(y, res, chunk)
        bits = bits.view(W, part // 8)
        scales = scales.view(2, W, part // chunk).transpose(0, 1).reshape(W, -1)
        return torch.cat([bits, scales.contiguous().view(torch.uint8)], dim=1)

    def _padded_layout(self, ctx, chunk):
        """([(offset in x, offset in the padded vector, numel)] per parameter, padded length)."""
        key = (tuple((p.name, p.numel) for p in ctx.params), chunk)
        hit = self._layouts.get(key)
        if hit is None:
            pieces, off = [], 0
            for p in ctx.params:
                pieces.append((p.offset, off, p.numel))
                off += -(-p.numel // chunk) * chunk
            hit = self._layouts[key] = (pieces, off)
        return hit


def _spread(src, dst, pieces):
    """Copy the flat bucket ``src`` into the padded vector ``dst``, one parameter at a time."""
    for s, d, n in pieces:
        dst[d : d + n].copy_(src[s : s + n])


def _gather(src, dst, pieces):
    """Inverse of :func:`_spread`."""
    for s, d, n in pieces:
        dst[s : s + n].copy_(src[d : d + n])
