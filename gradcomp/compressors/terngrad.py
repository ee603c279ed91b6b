"""TernGrad (Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed
Deep Learning", NeurIPS 2017, arXiv:1705.07878).

Algorithm, per step, per layer (parameter) l of at least ``min_numel`` elements (smaller
ones go dense):
  1. y = g (+ e with ``error_feedback=True``; off by default, as in the paper). The
     rounding error is about as large as y itself (clipped at 2.5 sigma, E|s q - y|^2 =
     s |y|_1 - |y|^2 ~ |y|^2 for Gaussian-like y), so error feedback does not contract:
     the residual grows like a random walk and its noise goes out with every later
     message. Measured (bench/RESULTS.md, section 4): ResNet-18's first epoch diverges with
     it (training loss 3.79 against 2.29 without), and 10 epochs of the small model end
     4.8 points lower with it when every tensor is compressed. The message is unbiased
     without it.
  2. Clip y_l to [-c sigma_l, c sigma_l] (sigma_l: standard deviation of y_l; c = ``clip``).
  3. Scaler s_l = max |y_l|; with ``share_scalers`` every rank uses the maximum over ranks
     (one small allreduce), as in the paper's scaler sharing.
  4. q = sign(y) * Bernoulli(|y| / s): E[s q] = y (unbiased). Two bits per element; each
     layer draws its own random stream, so its codes do not depend on its bucket.
  5. Allgather the packed codes (and scalers when not shared, and the dense layers' values);
     decode s * q; average.
Each rank sends n/4 bytes (+4 bytes per layer): 16x less than fp32, but allgather means
every rank receives (W-1) * n/4 bytes, so the saving shrinks as W grows past 8 or so.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..config import MethodConfig, check
from .base import Compressor, dense_values, put_dense, register_method


@dataclass(frozen=True)
class TernGradConfig(MethodConfig):
    """clip: clip at clip * sigma per layer (0 = off; the paper uses 2.5).
    share_scalers: one scaler per layer for all ranks (max over ranks).
    error_feedback: off by default (see the module docstring: it does not contract here)."""

    error_feedback: bool = False
    clip: float = 2.5
    share_scalers: bool = True

    def validate(self):
        check(self.clip >= 0, "clip", self.clip, "a number >= 0 (0 = off)")


def layer_stats(y: torch.Tensor, lengths: torch.Tensor, clip: float, pieces=None) -> torch.Tensor:
    """Clip y in place at clip * sigma per segment (consecutive runs of ``lengths``); return
    the per-segment max |y|. ``pieces`` [(.., .., start, length)] clips segment by segment
    (bounds stay on the device) instead of spreading the bound over every element."""
    if clip:
        mean = torch.segment_reduce(y, "mean", lengths=lengths)
        meansq = torch.segment_reduce(y * y, "mean", lengths=lengths)
        bound = (meansq - mean * mean).clamp_min(0).sqrt().mul_(clip)
        if pieces is None:
            full = torch.repeat_interleave(bound, lengths, output_size=y.numel())
            torch.minimum(y, full, out=y)
            torch.maximum(y, -full, out=y)
        else:
            for i, (*_, at, m) in enumerate(pieces):
                seg = y[at : at + m]
                torch.clamp(seg, min=-bound[i : i + 1], max=bound[i : i + 1], out=seg)
    return torch.segment_reduce(y.abs(), "max", lengths=lengths)


@register_method
class TernGrad(Compressor):
    Config = TernGradConfig
    name = "terngrad"
    residual_slot = "residual"
    description = "TernGrad: unbiased stochastic ternary {-1,0,+1} x per-layer scaler, 2 bits"

    def __init__(self, config):
        super().__init__(config)
        self._layouts = {}

    def reduce(self, x, ctx):
        big, dense = self.split(ctx.params)
        if not big:
            return self.dense(x, ctx)
        cfg, W = self.config, ctx.comm.world_size
        pieces, npad, lengths = self._layout(big, x.device)
        y = _spread(x, pieces, npad)
        e = ctx.memory("residual") if cfg.error_feedback else None
        res = None
        if e is not None:
            res = _spread(e, pieces, npad)
            y.add_(res)
            unclipped = y.clone() if cfg.clip else None
        scale = layer_stats(y, lengths, cfg.clip, pieces)
        if cfg.share_scalers:
            ctx.comm.allreduce(scale, op="max")
        packed = torch.empty(npad // 4, dtype=torch.uint8, device=x.device)
        zeros = lengths.new_zeros(max(m for *_, m in pieces))  # segment ids of one layer
        for i, ((off, n, at, m), p) in enumerate(zip(pieces, big)):
            r = res[at : at + m].zero_() if res is not None else None
            packed[at // 4 : (at + m) // 4] = kernels.ternary_compress(
                y[at : at + m], r, scale[i : i + 1], zeros[:m], ctx.seed(0, p.name))
        if res is not None:
            if cfg.clip:  # what clipping removed is fed back too
                res.add_(unclipped).sub_(y)
            _gather(res, e, pieces)
        tail = dense_values(x, dense).view(torch.uint8)
        if cfg.share_scalers:
            got = ctx.comm.allgather(torch.cat([packed, tail]))
            scales = scale.expand(W, len(big))
        else:
            got = ctx.comm.allgather(torch.cat([packed, scale.view(torch.uint8), tail]))
            scales = got[:, packed.numel() : packed.numel() + 4 * len(big)].contiguous()
            scales = scales.view(torch.float32)
        full = torch.zeros(npad, dtype=torch.float32, device=x.device)
        scales = scales.t().contiguous()  # (layers, W): each layer's W scales contiguous
        for i, (_, _, at, m) in enumerate(pieces):  # one layer at a time: one scale each
            kernels.ternary_decompress(got[:, at // 4 : (at + m) // 4].contiguous(),
                                       scales[i].view(W, 1), zeros[:m], full[at : at + m], 1.0 / W)
        out = torch.empty_like(x)
        _gather(full, out, pieces)
        put_dense(got[:, got.shape[1] - tail.numel() :], dense, out)
        return out

    def _layout(self, params, device):
        """Each layer padded to whole bytes of codes (a multiple of 4 elements): pieces
        [(offset in x, numel, offset padded, padded numel)], padded length and the padded
        lengths."""
        key = (tuple((p.name, p.offset, p.numel) for p in params), str(device))
        hit = self._layouts.get(key)
        if hit is None:
            pieces, at = [], 0
            for p in params:
                m = -(-p.numel // 4) * 4
                pieces.append((p.offset, p.numel, at, m))
                at += m
            lengths = torch.tensor([m for *_, m in pieces], device=device)
            hit = self._layouts[key] = (pieces, at, lengths)
        return hit


def _spread(src, pieces, npad):
    dst = torch.empty(npad, dtype=torch.float32, device=src.device)
    for off, n, at, m in pieces:
        dst[at : at + n] = src[off : off + n]
        dst[at + n : at + m].zero_()  # the padding (up to 3 elements)
    return dst


def _gather(src, dst, pieces):
    for off, n, at, _ in pieces:
        dst[off : off + n] = src[at : at + n]
