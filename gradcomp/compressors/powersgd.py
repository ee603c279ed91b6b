"""PowerSGD (Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019, arXiv:1905.13727).

Each parameter of 2+ dims is viewed as an n x m matrix M (n = first dim). When rank r
saves at least ``min_compression_rate`` (n m / ((n + m) r)) and the tensor has at least
``min_numel`` elements it is compressed, otherwise it goes uncompressed.

Algorithm, per bucket and step (one power iteration, warm-started):
  1. M = G + E (error feedback, fp32).
  2. P = M Q  (Q from the previous step; at the first step random, the same on all ranks).
  3. Allreduce [P for every matrix, uncompressed tensors] as ONE buffer.
  4. P = orthonormal basis of P (QR).
  5. Q = M^T P; allreduce Q.
  6. Approximation M' = P Q^T / W;  E = M - M'. Q is kept for the next step.
Sends (n + m) r floats per matrix instead of n m.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MethodConfig, check
from .base import Compressor, dense_values, name_seed, register_method


@dataclass(frozen=True)
class PowerSGDConfig(MethodConfig):
    """rank: rank r of the approximation (>= 1). min_compression_rate: compress a matrix only
    when that saves at least this factor (0 = always, e.g. to test full rank)."""

    rank: int = 2
    min_compression_rate: float = 2.0

    def validate(self):
        check(self.rank >= 1, "rank", self.rank, "an integer >= 1")
        check(self.min_compression_rate >= 0, "min_compression_rate",
              self.min_compression_rate, "a number >= 0")


@register_method
class PowerSGD(Compressor):
    Config = PowerSGDConfig
    name = "powersgd"
    # no residual_slot: its residual is M_i - P P^T (average of the M_j), so it also holds this
    # rank's deviation from the average, which is never sent; approx_error is its own measure
    description = "PowerSGD: rank-r power iteration with warm start and error feedback"

    def plan(self, params):
        """Split a bucket's parameters into compressed matrices (p, n, m, r) and dense ones."""
        cfg = self.config
        mats, dense = [], []
        for p in params:
            if len(p.shape) >= 2 and p.size >= cfg.min_numel:
                n, m = p.shape[0], p.numel // p.shape[0]
                r = min(cfg.rank, n, m)
                if n * m >= cfg.min_compression_rate * (n + m) * r:
                    mats.append((p, n, m, r))
                    continue
            dense.append(p)
        return mats, dense

    def reduce(self, x, ctx):
        cfg, W = self.config, ctx.comm.world_size
        mats, dense = self.plan(ctx.params)
        if not mats:
            return self.dense(x, ctx)
        if cfg.error_feedback:
            e = ctx.memory("residual")
            x.add_(e)
        # Matrices are copied out of the bucket: BLAS results can depend on a buffer's
        # alignment, and a view's alignment depends on the bucket layout (see base.py).
        Ms, Qs = [], []
        for p, n, m, r in mats:
            Ms.append(x[p.offset : p.offset + p.numel].view(n, m).clone())
            Qs.append(ctx.tensor("q", p.name, lambda p=p, m=m, r=r: _init_q(cfg.seed, p.name, m, r, x.device)))
        # 1st collective: every P and every uncompressed tensor together
        Ps = [M @ Q for M, Q in zip(Ms, Qs)]
        buf = torch.cat([P.reshape(-1) for P in Ps] + [dense_values(x, dense)])
        ctx.comm.allreduce(buf)
        sizes = [P.numel() for P in Ps]
        Ps = [_orthonormal(c.view(P.shape).clone()) for P, c in zip(Ps, buf[: sum(sizes)].split(sizes))]
        # 2nd collective: every Q
        qbuf = torch.cat([(M.t() @ P).reshape(-1) for M, P in zip(Ms, Ps)])
        ctx.comm.allreduce(qbuf)
        out = x.clone() if cfg.error_feedback else x
        for (p, n, m, r), P, Qnew, Q in zip(mats, Ps, qbuf.split([m * r for _, _, m, r in mats]), Qs):
            Q.copy_(Qnew.view(m, r))
            out[p.offset : p.offset + p.numel] = (P @ Q.t()).div_(W).view(-1)
        dense_sum = buf[sum(sizes):]
        off = 0
        for p in dense:
            out[p.offset : p.offset + p.numel] = dense_sum[off : off + p.numel] / W
            off += p.numel
        if ctx.details:  # how much of this rank's matrix the shared rank-r basis P misses
            err = [(M - P @ (P.t() @ M)).norm() / (M.norm() + 1e-30) for M, P in zip(Ms, Ps)]
            ctx.log("approx_error", torch.stack(err).mean())
        if cfg.error_feedback:
            torch.sub(x, out, out=e)
            for p in dense:  # sent exactly: no error
                e[p.offset : p.offset + p.numel].zero_()
        return out


def _init_q(seed: int, name: str, m: int, r: int, device) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(name_seed(seed, name))
    return _orthonormal(torch.randn(m, r, generator=g)).to(device)


def _orthonormal(a: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of a's columns (reduced QR), written back into a."""
    if a.shape[1] == 1:
        return a.div_(a.norm() + 1e-12)
    q, _ = torch.linalg.qr(a)
    return a.copy_(q)
