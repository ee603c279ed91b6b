"""TernGrad (Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed
Deep Learning", NeurIPS 2017, arXiv:1705.07878).

Algorithm, per step, per layer (parameter) l of at least ``min_numel`` elements (smaller
ones go dense):
  1. y = g (+ e with ``error_feedback=True``; off by default, as in the paper). The
     rounding error is about as large as y itself (clipped at 2.5 sigma, E|s q - y|^2 =
     s |y|_1 - |y|^2 ~ |y|^2 for Gaussian-like y), so error feedback does not contract:
     the residual grows like a random walk and its noise goes out with every later
     message. Measured (bench/RESULTS.md, "Accuracy with SGD"): ResNet-18's first epoch diverges with
     it (training loss 3.79 against 2.29 without), and 10 epochs of the small model end
     4.8 points lower with it when every tensor is compressed. The message is unbiased
     without it.
  2. Clip y_l to [-c sigma_l, c sigma_l] (sigma_l: standard deviation of y_l; c = ``clip``).
  3. Scaler s_l = max |y_l|; with ``share_scalers`` every rank uses the maximum over ranks
     (one small allreduce), as in the paper's scaler sharing.
  4. q = sign(y) * Bernoulli(|y| / s): E[s q] = y (unbiased). Two bits per element; each
     layer draws its own random stream (Philox4x32-10, ``tl.rand4x``: key = the layer's
     seed for this step; element j of the layer takes word j % 4 of counter j // 4, one
     Philox per four elements), so its codes do not depend on its bucket, and the CPU
     reference and the GPU kernel draw the same numbers.
  5. Allgather the codes, five to a byte in base 3 (3^5 = 243 <= 256: 1.6 bits a value),
     the scalers when not shared, and the dense layers' values as they are (fp32); decode s * q;
     average. A bucket of dense layers alone goes the same way in the compressed steps (a
     layer's result never depends on its bucket's neighbours).
Each rank sends n/5 bytes (+4 bytes per layer, +4 per dense value): 20x less than fp32, but
allgather means every rank receives (W-1) * n/5 bytes, so the saving shrinks as W grows past
8 or so.

Per-layer semantics, per-bucket execution: a bucket's layers are described once per layout
(the moves between x and the padded layout as runs, segment ids and starts, where each layer
and dense parameter lies in x, cached), so a bucket costs the same number of ops whatever its
layer count. On the Triton path without error feedback (the default on a GPU) the kernels
read and write the bucket itself: the statistics (two kernels: every chunk's sums, then every
layer's sigma and scaler), the seeds' copy to the device, ONE ternary_encode writing the
message (the base-3 codes and the dense values), one allgather, ONE ternary_decode writing
every element of the bucket (the dense values' average and the inf/NaN guard's verdict
too): five launches besides the collectives with shared scalers (the default), six with a
scaler per rank (the scalers' copy into the message). Elsewhere, and with error feedback: one move in (a cat of views), one segmented
statistics pass, ONE ternary_compress over the whole bucket (a seed per layer), the base-3
packing, one allgather, its unpacking, ONE ternary_decompress, one move out.

Since the segmented rewrite the random stream is Philox (before: one ``torch.Generator``
per layer), and since issue 35 each Philox call serves four elements (before: one, its
first word only), so codes differ from those of earlier versions for the same seed;
checkpoints still load (TernGrad's default keeps no residual; with ``error_feedback=True``
the residual carries over as it is).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels
from ..config import Adam, MethodConfig, RESIDUAL, check
from ..kernels.host import to_device
from .base import Compressor, Runs, dense_values, put_dense, register_method, scratch
from .wire import Field, Message


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


def layer_stats(y: torch.Tensor, lengths: torch.Tensor, clip: float,
                seg: torch.Tensor | None = None, sizes: list[int] | None = None) -> torch.Tensor:
    """Clip y in place at clip * sigma per segment (consecutive runs of ``lengths``); return
    the per-segment max |y|. ``seg``: each element's segment id (else built here); ``sizes``:
    ``lengths`` as a list, for the CPU's path (:func:`_stats_by_segment`) and, with ``seg``,
    the GPU's (:func:`_stats_by_norms`)."""
    n, dev = y.numel(), y.device
    if sizes is not None and dev.type == "cpu":
        return _stats_by_segment(y, lengths, clip, sizes)
    if sizes is not None and seg is not None:
        return _stats_by_norms(y, lengths, clip, seg, sizes)
    if clip:
        mean = torch.segment_reduce(y, "mean", lengths=lengths)
        sq = torch.mul(y, y, out=scratch("terngrad.stats", n, torch.float32, dev))
        meansq = torch.segment_reduce(sq, "mean", lengths=lengths)
        bound = (meansq - mean * mean).clamp_min_(0).sqrt_().mul_(clip)
        if seg is None:
            full = torch.repeat_interleave(bound, lengths, output_size=n)
        else:
            full = torch.index_select(bound, 0, seg, out=scratch("terngrad.bound", n, torch.float32, dev))
        low = torch.neg(full, out=scratch("terngrad.stats", n, torch.float32, dev))
        torch.clamp(y, min=low, max=full, out=y)
    mag = torch.abs(y, out=scratch("terngrad.stats", n, torch.float32, dev))
    return torch.segment_reduce(mag, "max", lengths=lengths)


def _stats_by_norms(y: torch.Tensor, lengths: torch.Tensor, clip: float, seg: torch.Tensor,
                    sizes: list[int]) -> torch.Tensor:
    """:func:`layer_stats` on a GPU, by multi-tensor norms over y's segments (views) in place
    of segment reductions: torch's CUDA ``segment_reduce`` took 8-10 ms per reduction over
    GPT-2 small's 163M elements on an H100, ``_foreach_norm`` 0.5 (bench/RESULTS.md, "Kernels on a GPU").

    * max |y| is each segment's inf-norm (exact), and max |clip(y)| = min(max |y|, bound);
    * a segment's sum of squares is the 1-norm of y * y; its sum is 2 * (1-norm of
      max(y, 0)) - (1-norm of y). That difference loses about one rounding of the sum of
      |y| (eps * mean |y| on the mean), which the variance (mean square minus the square of
      the mean) does not feel: its error is 2 * mean * that, against sigma^2.

    Deterministic (the same bits on every run: resume stays bit-exact), within a few
    roundings of the element path's sums, which add in another order."""
    n = y.numel()
    parts = y.split(sizes)
    top = torch.stack(torch._foreach_norm(parts, float("inf")))
    if not clip:
        return top
    buf = scratch("terngrad.stats", n, torch.float32, y.device)
    total_abs = torch.stack(torch._foreach_norm(parts, 1))
    total_sq = torch.stack(torch._foreach_norm(torch.mul(y, y, out=buf).split(sizes), 1))
    total_pos = torch.stack(torch._foreach_norm(torch.clamp_min(y, 0, out=buf).split(sizes), 1))
    mean = (2 * total_pos - total_abs) / lengths
    bound = (total_sq / lengths - mean * mean).clamp_min_(0).sqrt_().mul_(clip)
    full = torch.index_select(bound, 0, seg, out=scratch("terngrad.bound", n, torch.float32,
                                                             y.device))
    torch.clamp(y, min=torch.neg(full, out=buf), max=full, out=y)
    return torch.minimum(top, bound)


_SQ_EXACT = 2.0**-126  # from here up (and finite), sqrt(fl(a * a)) == |a|: see below


def _stats_by_segment(y: torch.Tensor, lengths: torch.Tensor, clip: float,
                      sizes: list[int]) -> torch.Tensor:
    """:func:`layer_stats` on the CPU, by multi-tensor ops over y's segments (views):

    * the max |y| is the square root of each segment's max y * y (``_foreach_max``, one
      vectorized pass over the squares the clip computes anyway), in place of |y| and a
      segment reduction (which is not vectorized: 39 ms at 11M elements against 5). It is
      exact: a correctly rounded square root of a correctly rounded square gives |a| back
      for every float whose square is normal and finite (checked exhaustively on [1, 2),
      which every binade scales from: |a| in [2^-63, 2^64)), and squaring keeps the order.
      Segments whose largest square is outside that range (zeros, tiny or huge values) take
      an exact inf-norm.
    * the clip is two in-place clamps against each segment's bound (as torch.clamp: the
      max with -b, then the min with b), in place of a bound per element (a gather), its
      negation and a clamp between them; and max |clip(y)| = min(max |y|, b) exactly.

    * the mean and mean square are each segment's sum by numpy's ``add.reduceat`` (pairwise
      and vectorized: 4 ms at 11M elements against 30 for ``torch.segment_reduce``, whose
      CPU kernel adds one element at a time, and closer to the float64 sums), divided by
      its length.

    Without clipping, the same scales bit for bit as :func:`layer_stats`' per-element path.
    With it, the bound differs from that path's in the last bits (its sums add in another
    order), so the scales and clipped values do too; deterministic on a machine (numpy
    picks its SIMD width from the CPU), so a run resumes bit-exactly. A zero's sign may
    differ where a segment's bound is 0, which no code or scale depends on."""
    n = y.numel()
    parts = y.split(sizes)
    sq = torch.mul(y, y, out=scratch("terngrad.stats", n, torch.float32, y.device))
    top = torch.stack(torch._foreach_max(sq.split(sizes)))  # per segment: max y * y
    odd = ((top < _SQ_EXACT) | torch.isinf(top)).nonzero().flatten().tolist()
    scale = top.sqrt_()
    if odd:
        scale[odd] = torch.stack(torch._foreach_norm([parts[i] for i in odd], float("inf")))
    if clip:
        mean = _segment_sums(y, sizes).div_(lengths)
        meansq = _segment_sums(sq, sizes).div_(lengths)
        bound = (meansq - mean * mean).clamp_min_(0).sqrt_().mul_(clip)
        torch._foreach_clamp_min_(parts, bound.neg().tolist())
        torch._foreach_clamp_max_(parts, bound.tolist())
        torch.minimum(scale, bound, out=scale)
    return scale


def _segment_sums(t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Each segment's sum (consecutive runs of ``sizes``) of a CPU tensor, by numpy's pairwise
    ``add.reduceat`` (empty segments: torch's segment sum, as reduceat gives them an
    element, not 0)."""
    if min(sizes) == 0:
        return torch.segment_reduce(t, "sum", lengths=torch.tensor(sizes))
    starts = np.cumsum([0] + sizes[:-1])
    return torch.from_numpy(np.add.reduceat(t.detach().numpy(), starts))


MESSAGE = Message(
    "every rank's codes, all-gathered",
    Field("codes", torch.uint8, "(npad + 4) // 5", "each value's ternary code (0: 0, 1: +1, "
          "2: -1), five per byte in base 3 (byte = c0 + 3 c1 + 9 c2 + 27 c3 + 81 c4, the first "
          "value in c0): 1.6 bits a value; each compressed layer padded to a multiple of 4 "
          "values, the last byte's missing values 0"),
    Field("scales", torch.float32, "n_scales", "each compressed layer's scaler (its max "
          "magnitude after clipping); none with `share_scalers` (a max-allreduce before "
          "gives every rank the same ones)"),
    Field("dense", torch.float32, "n_dense", "the values of the parameters sent "
          "uncompressed (below `min_numel`, or named in `exact`), as they are (fp32)"))

def base3_digits(device) -> tuple[torch.Tensor, torch.Tensor]:
    """(a 2-bit code's place in the kernels' bytes: 0, 2, 4, 6; a code's weight in a base-3
    byte: 1, 3, 9, 27, 81), first value lowest, made on ``device`` (a layout keeps them:
    nothing made in a step)."""
    return (torch.arange(0, 8, 2, dtype=torch.uint8, device=device),
            3 ** torch.arange(5, dtype=torch.uint8, device=device))


def to_base3(packed: torch.Tensor, n: int, digits: tuple) -> torch.Tensor:
    """The kernels' codes, four 2-bit codes a byte (``n`` codes, a multiple of 4) -> five a
    byte in base 3 (the message's ``codes``): 1.6 bits a value instead of 2. Lossless.
    ``digits``: :func:`base3_digits` on packed's device."""
    shifts, powers = digits
    c = (packed.unsqueeze(-1) >> shifts) & 3
    c = torch.nn.functional.pad(c.view(-1), (0, -n % 5)).view(-1, 5)
    return (c * powers).sum(1, dtype=torch.uint8)


def from_base3(b: torch.Tensor, n: int, digits: tuple) -> torch.Tensor:
    """:func:`to_base3`'s inverse, per rank: (W, bytes) -> (W, n / 4), four codes a byte."""
    shifts, powers = digits
    c = (b.unsqueeze(-1) // powers) % 3
    c = c.view(b.shape[0], -1)[:, :n].reshape(b.shape[0], -1, 4)
    return (c << shifts).sum(2, dtype=torch.uint8)


@register_method
class TernGrad(Compressor):
    Config = TernGradConfig
    name = "terngrad"
    residual_slot = RESIDUAL
    # unbiased, no residual: with AdamW its gradient held better than its first moment
    # (600-step GPT probe, seed 0: -1.2% against +0.6% from allreduce)
    adam_exchange = Adam.FREEZE
    # with Adam/AdamW the warm-up in int4 rows: an eighth of fp32's bytes, so that the
    # warm-up is not most of a short run's bytes (bench/RESULTS.md, "Accuracy with AdamW")
    adam_defaults = {"dense_wire": "int4"}
    # (Compressor.measured) AdamW: 2000 steps, seeds 0-2, 1.5733 / 1.5880 / 1.5806 against
    # allreduce's 1.6083 / 1.6027 / 1.6227, 16.8x fewer bytes over the run (DDP: the clip off
    # the compressed steps; with it on, as under FSDP/HSDP, 1.5836 / 1.5791 / 1.5908)
    measured = {"sgd_points": -0.9, "adamw_gap_pct": {"freeze": -1.90}}
    description = ("TernGrad: unbiased stochastic ternary {-1,0,+1} x per-layer scaler, 1.6 bits "
                   "(five values a byte)")
    messages = (MESSAGE,)

    def __init__(self, config):
        super().__init__(config)
        self._layouts = {}

    def exchange(self, x, ctx, big, dense):
        cfg, W = self.config, ctx.comm.world_size
        lay = self._layout(ctx.params, big, dense, x.device)
        if not cfg.error_feedback and kernels.backend("ternary_encode", x) == "triton":
            return self._exchange_fused(x, ctx, lay, big)
        y = lay.spread(x, "terngrad.y")
        # the residual is rewritten whole (gather, then the dense parameters' zeros)
        e_now, e = ctx.memory_next(RESIDUAL) if cfg.error_feedback else (None, None)
        res = None
        if e is not None:
            res = lay.spread(e_now, "terngrad.res")
            y.add_(res)
            unclipped = (scratch("terngrad.unclipped", y.numel(), y.dtype, y.device).copy_(y)
                         if cfg.clip else None)
        scale = layer_stats(y, lay.lengths, cfg.clip, lay.seg, lay.sizes)
        if cfg.share_scalers:
            ctx.comm.allreduce(scale, op="max")
        seeds = to_device([ctx.seed(0, p.name) for p in big], torch.int64, x.device)
        if res is not None:
            res.zero_()  # the kernel adds it to y (already in y) and leaves y - s q there
        packed = kernels.ternary_compress(y, res, scale, lay.seg, seeds, lay.starts)
        if res is not None:
            if cfg.clip:  # what clipping removed is fed back too
                res.add_(unclipped).sub_(y)
            lay.gather(res, e)
            lay.zero_dense(e)  # sent exactly
        d = dense_values(x, dense)
        sent = scale[:0] if cfg.share_scalers else scale  # shared: every rank has them
        msg = MESSAGE.bind(npad=lay.npad, n_scales=sent.numel(), n_dense=d.numel())
        got = msg.unpack(ctx.comm.allgather(msg.pack(
            codes=to_base3(packed, lay.npad, lay.digits), scales=sent, dense=d)))  # every rank's, in order
        scales = (scale.expand(W, len(big)).contiguous() if cfg.share_scalers
                  else got["scales"].contiguous())
        codes = from_base3(got["codes"].reshape(W, -1), lay.npad, lay.digits)
        full = scratch("terngrad.full", lay.npad, torch.float32, x.device)
        kernels.ternary_decompress(codes, scales, lay.seg, full, 1.0 / W, accumulate=False)
        out = x  # x is not read again (its dense values are in the message): no fresh buffer
        lay.gather(full, out)
        put_dense(got["dense"], dense, out)
        return out

    def _exchange_fused(self, x, ctx, lay, big):
        """:meth:`exchange` without error feedback on the Triton path, read from x and written
        back into it by the kernels themselves: the statistics (two kernels on a GPU), the
        seeds' copy to the device, one encoder writing the message's codes and dense values,
        one allgather, one decoder writing every element of x (the dense values' average
        too). The same bits as the other paths, but for the GPU's statistics
        (:func:`~gradcomp.kernels.reference.ternary_stats`: sums in the kernels' order)."""
        cfg, W, S = self.config, ctx.comm.world_size, len(big)
        msg = MESSAGE.bind(npad=lay.npad, n_scales=0 if cfg.share_scalers else S,
                           n_dense=lay.n_dense)
        buf = torch.empty(msg.nbytes, dtype=torch.uint8, device=x.device)
        if x.device.type == "cpu":  # Triton's interpreter: the CPU's statistics, bit for bit
            src = lay.spread(x, "terngrad.y")
            scale = layer_stats(src, lay.lengths, cfg.clip, lay.seg, lay.sizes)
            soff, snum, bound = lay.starts, lay.lengths, None  # src is clipped already
        else:
            scale, bound = kernels.implementation("ternary_stats", x)(
                x, lay.xoff, lay.numel, lay.lengths, cfg.clip, lay.chunks)
            src, soff, snum, bound = x, lay.xoff, lay.numel, bound if cfg.clip else None
        if cfg.share_scalers:
            ctx.comm.allreduce(scale, op="max")
        else:
            _field(buf, msg, "scales").copy_(scale)
        seeds = to_device([ctx.seed(0, p.name) for p in big], torch.int64, x.device)
        a, n_codes, _ = msg.spans["codes"]
        kernels.implementation("ternary_encode", x)(
            src, soff, snum, scale, bound, lay.seg, seeds, lay.starts, buf[a : a + n_codes],
            x, lay.dense, _field(buf, msg, "dense") if lay.n_dense else None)
        got = ctx.comm.allgather(buf)  # every rank's, in order
        scales = scale.expand(W, S) if cfg.share_scalers else _field(got, msg, "scales")
        dense = _field(got, msg, "dense") if lay.n_dense else None
        kernels.implementation("ternary_decode", x)(
            got[:, a : a + n_codes], scales, dense, lay.xseg, lay.entry_off, lay.entry_src, S,
            x, 1.0 / W, ctx.verdict(x))
        return x

    def dense(self, x, ctx):
        """A bucket of parameters sent uncompressed: in a compressed step as the message's
        ``dense`` field goes (every rank's fp32 values by allgather, summed in rank order,
        divided by W: :func:`put_dense`'s arithmetic; with 2 ranks a plain allreduce's bits), so a parameter's result does not
        depend on whether it shares its bucket with compressed ones; the warm-up's steps as
        ``dense_wire`` says."""
        if getattr(ctx, "dense_wire", None) is not None:
            return super().dense(x, ctx)
        got = ctx.comm.allgather(x.contiguous().view(torch.uint8))
        put_dense(got, ctx.params, x)
        return x

    def _layout(self, params, big, dense, device):
        key = (tuple((p.name, p.offset, p.numel, p.size) for p in params), str(device))
        hit = self._layouts.get(key)
        if hit is None:
            hit = self._layouts[key] = _TernaryLayout(big, dense, sum(p.numel for p in params), device)
        return hit


def _field(buf: torch.Tensor, msg, name: str) -> torch.Tensor:
    """The fp32 field ``name`` of one message (nbytes,) or of every rank's (W, nbytes), as a
    view (rows a message apart)."""
    a, n, _ = msg.spans[name]
    return buf[..., a : a + 4 * n].view(torch.float32)


class _TernaryLayout:
    """A bucket's compressed layers, each padded to whole bytes of codes (a multiple of 4
    elements, zeros), laid end to end: built once per bucket layout and device.

    npad: padded length; lengths, starts: (S,) int64 padded length and first element of
    each layer; seg: (npad,) int32 layer of each element; dense: int64 positions of the
    dense parameters in x; digits: the base-3 packing's constants (:func:`base3_digits`);
    to_padded, to_x: the moves between x's layout and the padded one, as
    runs (one ``torch.cat`` of views each, on every device: on an H100 0.63 ms for GPT-2
    small's 163M elements against 0.82 for a gather by an int32 position per element, which
    also cost 12 bytes per element of tables; bench/RESULTS.md, "Kernels on a GPU"). Cached per layout."""

    def __init__(self, params, dense, n, device):
        lengths, starts, at = [], [], 0
        for p in params:
            m = -(-p.numel // 4) * 4
            starts.append(at)
            lengths.append(m)
            at += m
        self.npad = at
        kw = dict(dtype=torch.int64, device=device)
        self.lengths = torch.tensor(lengths, **kw)
        self.sizes = lengths
        self.starts = torch.tensor(starts, **kw)
        self.seg = torch.repeat_interleave(torch.arange(len(params), dtype=torch.int32),
                                           torch.tensor(lengths)).to(device)
        self.dense = (torch.cat([torch.arange(p.offset, p.offset + p.numel, **kw) for p in dense])
                      if dense else None)
        self.digits = base3_digits(device)
        # the fused path's tables (TernGrad._exchange_fused): each compressed layer's place
        # and size in x; an entry per layer then per dense parameter (its first element in x
        # and its first code or dense value in the message), and each element's entry
        self.xoff = torch.tensor([p.offset for p in params], **kw)
        self.numel = torch.tensor([p.numel for p in params], **kw)
        self.chunks = kernels.reference.stats_chunks([p.numel for p in params], device)
        self.n_dense = sum(p.numel for p in dense)
        dstarts = np.cumsum([0] + [p.numel for p in dense])[:-1].tolist()
        entries = list(params) + list(dense)
        self.entry_off = torch.tensor([p.offset for p in entries], **kw)
        self.entry_src = torch.tensor(starts + dstarts, **kw)
        xseg = torch.full((n,), -1, dtype=torch.int32)
        for k, p in enumerate(entries):
            xseg[p.offset : p.offset + p.numel] = k
        self.xseg = xseg.to(device)
        # one run per layer
        self.to_padded = Runs([(p.offset, a, p.numel) for p, a in zip(params, starts)], n, at)
        self.to_x = Runs([(a, p.offset, p.numel) for p, a in zip(params, starts)], at, n)

    def spread(self, src: torch.Tensor, key: str) -> torch.Tensor:
        """src (x's layout) in the padded layout, padding zero; in the work buffer ``key``
        (see :func:`scratch`)."""
        return self.to_padded(src, scratch(key, self.npad, torch.float32, src.device))

    def gather(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """dst = src (padded layout) in x's layout; the dense parameters' part is left
        undefined (see :meth:`zero_dense`; the result's is overwritten by put_dense)."""
        self.to_x(src, dst)

    def zero_dense(self, t: torch.Tensor) -> None:
        if self.dense is not None:
            t.index_fill_(0, self.dense, 0.0)
