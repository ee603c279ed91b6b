"""TernGrad (Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed
Deep Learning", NeurIPS 2017, arXiv:1705.07878).

Algorithm, per bucket and step, per layer (parameter) l:
  1. y = g (+ e when error_feedback; the paper has none, we default to it since clipping
     biases the estimate and feedback removes that bias over steps).
  2. Clip y_l to [-c sigma_l, c sigma_l] (sigma_l: standard deviation of y_l; c = ``clip``).
  3. Scaler s_l = max |y_l|; with ``share_scalers`` every rank uses the maximum over ranks
     (one small allreduce), as in the paper's scaler sharing.
  4. q = sign(y) * Bernoulli(|y| / s): E[s q] = y (unbiased). Two bits per element.
  5. Allgather the packed codes (and scalers when not shared); decode s * q; average.
Each rank sends n/4 bytes (+4 bytes per layer): 16x less than fp32, but allgather means
every rank receives (W-1) * n/4 bytes, so the saving shrinks as W grows past 8 or so.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..config import MethodConfig, check
from .base import Compressor, register_method


@dataclass(frozen=True)
class TernGradConfig(MethodConfig):
    """clip: clip at clip * sigma per layer (0 = off; the paper uses 2.5).
    share_scalers: one scaler per layer for all ranks (max over ranks)."""

    clip: float = 2.5
    share_scalers: bool = True

    def validate(self):
        check(self.clip >= 0, "clip", self.clip, "a number >= 0 (0 = off)")


def layer_stats(y: torch.Tensor, lengths: torch.Tensor, clip: float) -> torch.Tensor:
    """Clip y in place at clip * sigma per segment (consecutive runs of ``lengths``); return
    the per-segment max |y|."""
    if clip:
        mean = torch.segment_reduce(y, "mean", lengths=lengths)
        meansq = torch.segment_reduce(y * y, "mean", lengths=lengths)
        sigma = (meansq - mean * mean).clamp_min(0).sqrt()
        bound = torch.repeat_interleave(clip * sigma, lengths, output_size=y.numel())
        torch.minimum(y, bound, out=y)
        torch.maximum(y, -bound, out=y)
    return torch.segment_reduce(y.abs(), "max", lengths=lengths)


@register_method
class TernGrad(Compressor):
    Config = TernGradConfig
    name = "terngrad"
    description = "TernGrad: unbiased stochastic ternary {-1,0,+1} x per-layer scaler, 2 bits"

    def reduce(self, x, ctx):
        if self.small(x):
            return self.dense(x, ctx)
        cfg, W = self.config, ctx.comm.world_size
        n = x.numel()
        seg = ctx.segment_ids()
        nseg = len(ctx.params)
        lengths = torch.tensor([p.numel for p in ctx.params], device=x.device)
        e = ctx.memory("residual") if cfg.error_feedback else None
        if e is not None:
            x.add_(e)
            unclipped = x.clone() if cfg.clip else None
        scale = layer_stats(x, lengths, cfg.clip)
        if cfg.share_scalers:
            ctx.comm.allreduce(scale, op="max")
        pad = (-n) % 4
        y = torch.cat([x, x.new_zeros(pad)]) if pad else x
        segp = torch.cat([seg, seg.new_zeros(pad)]) if pad else seg
        res = torch.zeros_like(y) if e is not None else None
        packed = kernels.ternary_compress(y, res, scale, segp, ctx.seed(0))
        if e is not None:
            e.copy_(res[:n])
            if unclipped is not None:  # what clipping removed is fed back too
                e.add_(unclipped).sub_(x)
        out = torch.zeros(n, dtype=torch.float32, device=x.device)
        if cfg.share_scalers:
            codes = ctx.comm.allgather(packed)
            scales = scale.expand(W, nseg)
        else:
            got = ctx.comm.allgather(torch.cat([packed, scale.view(torch.uint8)]))
            codes = got[:, : packed.numel()].contiguous()
            scales = got[:, packed.numel():].contiguous().view(torch.float32)
        return kernels.ternary_decompress(codes, scales, seg, out, 1.0 / W)
