"""PowerSGD (Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019, arXiv:1905.13727).

Each parameter of 2+ dims is viewed as an n x m matrix M (n = first dim). When rank r
saves at least ``min_compression_rate`` (n m / ((n + m) r)) and the tensor has at least
``min_numel`` elements it is compressed, otherwise it goes uncompressed.

Algorithm, per bucket and step (one power iteration, warm-started):
  1. M = G + E (error feedback, fp32).
  2. P = M Q  (Q from the previous step; at the first step random, the same on all ranks).
  3. Allreduce [P for every matrix, uncompressed tensors] as ONE buffer.
  4. P = orthonormal basis of P (Gram-Schmidt, three passes: see :func:`orthonormalize`).
  5. Q = M^T P; allreduce Q.
  6. Approximation M' = P Q^T / W;  E = M - M'. Q is kept for the next step.
Sends (n + m) r floats per matrix instead of n m.

Per-parameter semantics, per-bucket execution, two paths with the same messages:
  * CPU: a bucket's matrices are grouped by shape (n, m, r) once per bucket layout (cached),
    and every step runs on a group as a batch: one gather of its matrices out of the
    bucket, ``torch.bmm`` for M Q, M^T P and P Q^T, a batched Gram-Schmidt, one scatter
    back. The op count grows with the number of distinct shapes in a bucket, not with the
    number of matrices (a transformer's blocks repeat a handful of shapes; a CNN has a few
    dozen).
  * GPU (Triton; ``GRADCOMP_KERNELS=triton`` runs it anywhere): one table of every matrix's
    place per bucket layout, and each of the four matrix steps is ONE launch over all of
    them, whatever their shapes (:mod:`gradcomp.kernels.lowrank`), the residual's update and
    the dense tensors' gather and average inside the first and the last, the Q's written
    where the memory holds them: four launches per bucket exchange (nine with the inf/NaN
    guard's, tests/test_launches.py). It agrees with the CPU path to float
    tolerance, not bit for bit.

Bit-exactness. A matrix's result must not depend on the other matrices of its batch (DDP
rebuilds its buckets, and a resumed job sees other buckets at its first step). Batched
``torch.linalg.qr`` on the CPU breaks that: LAPACK's result depends on the alignment of
each matrix in its internal batched copy, hence on the matrix's place in the batch
(measured with torch 2.13/MKL: a 65 x 2 P gives different bits at odd places), and so do
reductions over dim 1 (a batch of one is reduced as one whole tensor: other rounding). So
the orthonormalization is Gram-Schmidt as in the authors' code (epfml/powersgd,
``orthogonalize``), batched, reorthogonalized, its dot products as ``bmm``. bmm
computes each matrix of a batch on its own (tested: a matrix batched with other
companions, at other places, and alone: bit-identical), except that a batch of ONE
matrix-vector product takes another BLAS path, which :func:`bmm` avoids. This changed the
numbers from the per-matrix ``torch.linalg.qr`` and ``@`` of earlier versions (within
float tolerance, the same rank-r span): a run resumes bit-exactly from checkpoints of this
version; older checkpoints load and continue (Q and the residual keep their meaning).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import Adam, MethodConfig, RESIDUAL, check
from ..kernels import backend, lowrank
from .base import MAX_RUNS, Compressor, ParamSlice, Runs, name_seed, register_method, scratch
from .wire import Field, Message


@dataclass(frozen=True)
class PowerSGDConfig(MethodConfig):
    """rank: rank r of the approximation (>= 1; 4 by default: rank 2, PowerSGD's and torch's
    usual choice, lost 2.9-11 points on CIFAR ResNet-18 where rank 4 held, bench/RESULTS.md
    section 4). min_compression_rate: compress a matrix only
    when that saves at least this factor (0 = always, e.g. to test full rank)."""

    rank: int = 4
    min_compression_rate: float = 2.0

    def validate(self):
        check(1 <= self.rank <= 4096, "rank", self.rank,
              "an integer >= 1 and <= 4096 (P and Q hold rank columns per matrix)")
        check(self.min_compression_rate >= 0, "min_compression_rate",
              self.min_compression_rate, "a number >= 0")


# Both messages are sums: allreduced in place, the codec writing each matrix's block straight
# into them (the layout's p_spans, q_sizes), so they are declared here for docs/wire.md only
MESSAGES = (
    Message("first allreduce (a sum)",
            Field("P", torch.float32, "p_total", "each n x m matrix's M Q, n x r (r: `rank`); "
                  "matrices of one shape as one batch; orthonormalized after the sum"),
            Field("dense", torch.float32, "n_dense", "the tensors sent whole (vectors, and "
                  "matrices that `rank` would not shrink by `min_compression_rate`)")),
    Message("second allreduce (a sum)",
            Field("Q", torch.float32, "q_total", "each matrix's M^T P, m x r, with the summed "
                  "orthonormal P; the average is P Q^T / W")),
)


@register_method
class PowerSGD(Compressor):
    Config = PowerSGDConfig
    name = "powersgd"
    # with AdamW the low-rank gradient held better than the low-rank first moment (600-step
    # GPT probe, seed 0: +2.6% against +4.4% above allreduce)
    adam_exchange = Adam.FREEZE
    measured = {"sgd_points": -1.2, "adamw_gap_pct": {"freeze": 4.58}}  # (Compressor.measured)
    # no residual_slot: its residual is M_i - P P^T (average of the M_j), so it also holds this
    # rank's deviation from the average, which is never sent; approx_error is its own measure
    description = "PowerSGD: rank-r power iteration with warm start and error feedback"
    messages = MESSAGES

    def __init__(self, config):
        super().__init__(config)
        self._layouts = {}

    def compresses(self, name: str, shape: tuple) -> bool:
        return bool(self.plan([ParamSlice(name, tuple(shape), 0, math.prod(shape))])[0])

    def plan(self, params):
        """Split a bucket's parameters into compressed matrices (p, n, m, r) and dense ones."""
        cfg = self.config
        mats, dense = [], []
        for p in params:
            if len(p.shape) >= 2 and self.big(p.name, p.size):
                n, m = p.shape[0], p.numel // p.shape[0]
                r = min(cfg.rank, n, m)
                if n * m >= cfg.min_compression_rate * (n + m) * r:
                    mats.append((p, n, m, r))
                    continue
            dense.append(p)
        return mats, dense

    def reduce(self, x, ctx):
        cfg, W = self.config, ctx.comm.world_size
        lay = self._layout(ctx.params, x.device)
        if not lay.groups:
            return self.dense(x, ctx)
        # the residual is rewritten whole (E = M - M'), into e
        e_now, e = ctx.memory_next(RESIDUAL) if cfg.error_feedback else (None, None)
        qs = [[ctx.tensor("q", p.name, lambda p=p, g=g: _init_q(cfg.seed, p.name, g.m, g.r, x.device))
               for p in g.params] for g in lay.groups]
        if backend("powersgd_project", x) == "triton":
            # M = x + e inside the kernels, the result written into x: the matrices M kept
            # for the details below
            m_src = (x.clone() if e_now is None else x + e_now) if ctx.details else None
            out, buf = self._reduce_table(x, ctx, lay, qs, e_now, e)
        else:
            if e_now is not None:
                x.add_(e_now)
            # the matrices M, for the details below (without error feedback out is x, rewritten)
            m_src = x.clone() if ctx.details and e_now is None else x
            # by runs on the CPU, the result written into x (not with the details: they read M)
            moves = None if ctx.details or x.is_cuda else lay.moves(x.numel())
            if moves is not None:
                return self._reduce_runs(x, ctx, lay, qs, moves, e)
            out, buf = self._reduce_batched(x, ctx, lay, qs)
            lay.put_dense(out, buf, W)
            if e is not None:
                torch.sub(x, out, out=e)
                lay.zero_dense(e)  # sent exactly: no error
        if ctx.details:  # how much of this rank's matrix the shared rank-r basis P misses
            err = []
            for g, (a, b) in zip(lay.groups, lay.p_spans):
                M, P = g.take(m_src), buf[a:b].view(g.B, g.n, g.r)
                err.append(torch.linalg.vector_norm(M - bmm(P, bmm(P.transpose(1, 2), M)),
                                                    dim=(1, 2))
                           / (torch.linalg.vector_norm(M, dim=(1, 2)) + 1e-30))
            ctx.log("approx_error", torch.cat(err).mean())
        return out

    def _reduce_batched(self, x, ctx, lay, qs):
        """The CPU path: each shape's matrices as one batch (bmm, batched Gram-Schmidt).
        Returns (out with the matrices' average, the first message: orthonormal P's, then
        the dense parameters' sum)."""
        W = ctx.comm.world_size
        # the batches' matrices end to end (a view where they lie so in x: x is not written
        # before the last read of M, the Q's in _power_step)
        Ms = [g.take(x) for g in lay.groups]
        buf, Ps, Qs = _power_step(Ms, qs, lay.take_dense(x), lay, ctx)
        out = lay.result_buffer(x) if self.config.error_feedback else x
        for g, P, Q in zip(lay.groups, Ps, Qs):
            Q, scaled = _averaged(Q, W)
            M = bmm(P, Q.transpose(1, 2))
            g.put(out, M if scaled else M.div_(W))
        return out, buf

    def _reduce_runs(self, x, ctx, lay, qs, moves, e):
        """The CPU path where the bucket's parameters cover it (every DDP bucket): the same
        arithmetic as :meth:`_reduce_batched`, bit for bit, on the bucket gathered into its
        groups' order (one ``torch.cat`` of runs, :class:`Runs`): no per-element index, no
        fresh bucket-sized buffer, and the result written back into x (no copy after).
        e: the residual to write, or None (no error feedback)."""
        W, n = ctx.comm.world_size, x.numel()
        gather, scatter = moves
        mt = lay.mat_numel
        xg = gather(x, scratch("powersgd_m", n, x.dtype, x.device))  # M's, then the dense
        Ms = [xg[a:b].view(g.B, g.n, g.m) for g, (a, b) in zip(lay.groups, lay.m_spans)]
        buf, Ps, Qs = _power_step(Ms, qs, [xg[mt:]], lay, ctx)
        rg = scratch("powersgd_out", n, x.dtype, x.device)
        for g, P, Q, (c, d) in zip(lay.groups, Ps, Qs, lay.m_spans):
            Q, scaled = _averaged(Q, W)
            if g.B == 1:  # see bmm: a batch of one runs as two
                rg[c:d].copy_(bmm(P, Q.transpose(1, 2)).view(-1))
            else:
                torch.bmm(P, Q.transpose(1, 2), out=rg[c:d].view(g.B, g.n, g.m))
            if not scaled:
                rg[c:d].div_(W)
        torch.div(buf[lay.p_total :], W, out=rg[mt:])
        if e is not None:  # E = M - M' (the dense parameters were sent exactly: no error)
            torch.sub(xg[:mt], rg[:mt], out=xg[:mt])
            xg[mt:].zero_()
            scatter(xg, e)
        return scatter(rg, x)

    def _reduce_table(self, x, ctx, lay, qs, e_now, e):
        """The GPU path: every matrix of the bucket in one launch per step, whatever its
        shape (:mod:`gradcomp.kernels.lowrank`); the same messages as the batched path. The
        matrices are M = x + e_now (e_now None: x), the result is written into x and the
        next residual into e; the Q's are the memory's tensors, written where they lie.
        Four launches: the residual's update, the dense tensors' gather and their average
        ride in the first and the last, and the guard's verdict in the last."""
        W, table = ctx.comm.world_size, lay.table(x.device, x.numel())
        q = _one_buffer([v for group in qs for v in group], lay.q_sizes)
        buf = x.new_empty(lay.p_total + lay.dense_numel)
        lowrank.project(x, q, buf, table, e_now)  # every P, then the dense tensors' M
        ctx.comm.allreduce(buf)  # 1st collective: every P and every uncompressed tensor
        lowrank.orthonormalize(buf, table)
        lowrank.back(x, buf, q, table, e_now)  # the new Q's over the old ones (read by project)
        ctx.comm.allreduce(q)  # 2nd collective: every Q
        lowrank.expand(buf, q, x, table, W, e_now, e, verdict=ctx.verdict(x))
        return x, buf

    def _layout(self, params, device):
        key = (tuple((p.name, p.offset, p.numel, p.size) for p in params), str(device))
        hit = self._layouts.get(key)
        if hit is None:
            mats, dense = self.plan(params)
            hit = self._layouts[key] = _LowRankLayout(mats, dense, device)
        return hit


class _Group:
    """The B matrices of one shape (n, m, r) in a bucket, in bucket order: where they lie in x
    (one slice when they lie end to end, else an element index, built once)."""

    def __init__(self, mats, device):
        self.params = [p for p, *_ in mats]
        _, self.n, self.m, self.r = mats[0]
        self.B = len(mats)
        first = self.params[0].offset
        size = self.n * self.m
        if all(p.offset == first + i * size for i, p in enumerate(self.params)):
            self.span, self.idx = (first, first + self.B * size), None
        else:
            self.span = None
            self.idx = torch.cat([torch.arange(p.offset, p.offset + p.numel, device=device)
                                  for p in self.params])

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """(B, n, m): the group's matrices; a view of x where they lie end to end in it, else
        a copy."""
        if self.idx is None:
            flat = x[self.span[0] : self.span[1]]
        else:
            flat = x.index_select(0, self.idx)
        return flat.view(self.B, self.n, self.m)

    def put(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """out[the group's elements] = values (B, n, m)."""
        if self.idx is None:
            out[self.span[0] : self.span[1]].copy_(values.view(-1))
        else:
            out.index_copy_(0, self.idx, values.view(-1))


class _LowRankLayout:
    """A bucket's compressed matrices grouped by shape, its dense parameters, and where each
    group's P and Q lie in the two messages."""

    def __init__(self, mats, dense, device):
        by_shape: dict = {}
        for mat in mats:
            by_shape.setdefault(mat[1:], []).append(mat)
        self.groups = [_Group(g, device) for g in by_shape.values()]
        self.p_spans, self.q_spans, pa, qa = [], [], 0, 0
        for g in self.groups:
            self.p_spans.append((pa, pa + g.B * g.n * g.r))
            self.q_spans.append((qa, qa + g.B * g.m * g.r))
            pa, qa = pa + g.B * g.n * g.r, qa + g.B * g.m * g.r
        self.p_total = pa
        # the bucket gathered: every group's matrices end to end in group order, then the
        # dense parameters (the runs path)
        self.m_spans, at = [], 0
        for g in self.groups:
            self.m_spans.append((at, at + g.B * g.n * g.m))
            at += g.B * g.n * g.m
        self.mat_numel = at
        self._gathered = [p for g in self.groups for p in g.params] + list(dense)
        self._runs = None  # (gather, scatter), built on first use
        self.q_sizes = [g.m * g.r for g in self.groups for _ in range(g.B)]
        self.dense_idx = (torch.cat([torch.arange(p.offset, p.offset + p.numel, device=device)
                                     for p in dense]) if dense else None)
        self.dense_numel = sum(p.numel for p in dense)
        # where the matrices and the dense parameters, end to end with nothing between,
        # cover the bucket from 0: its end, else None
        spans = sorted((p.offset, p.offset + p.numel) for p in [m[0] for m in mats] + dense)
        self.covered = (spans[-1][1] if spans and all(
            a == b for (a, _), b in zip(spans, [0] + [e for _, e in spans])) else None)
        self._tables = {}

    def moves(self, n: int):
        """(gather, scatter) by runs between a bucket of n elements and its gathered order,
        or None where the parameters do not cover the bucket or are too many (MAX_RUNS)."""
        if self.covered != n or len(self._gathered) > MAX_RUNS:
            return None
        if self._runs is None:
            runs, at = [], 0
            for p in self._gathered:
                runs.append((p.offset, at, p.numel))
                at += p.numel
            self._runs = (Runs(runs, n, n), Runs([(d, s, k) for s, d, k in runs], n, n))
        return self._runs

    def result_buffer(self, x: torch.Tensor) -> torch.Tensor:
        """A buffer for the result beside x: uninitialized where the exchange writes every
        element of it (the matrices, then the dense parameters, cover the bucket), else a copy
        of x."""
        return torch.empty_like(x) if self.covered == x.numel() else x.clone()

    def table(self, device, n: int) -> lowrank.MatrixTable:
        """Every matrix's place in a bucket of n elements, in the P message and in the Q
        message; the dense parameters' places and those of no parameter (for the GPU path;
        built on first use)."""
        hit = self._tables.get(n)
        if hit is None:
            rows = []
            for g, (pa, _), (qa, _) in zip(self.groups, self.p_spans, self.q_spans):
                for b, p in enumerate(g.params):
                    rows.append((p.offset, g.n, g.m, g.r, pa + b * g.n * g.r, qa + b * g.m * g.r))
            rest, at = [], 0
            for a, b in sorted((p.offset, p.offset + p.numel) for p in self._gathered):
                if a > at:
                    rest.append((at, a - at))
                at = max(at, b)
            if n > at:
                rest.append((at, n - at))
            dense = [(p.offset, p.numel) for p in self._gathered[len(rows):]]
            hit = self._tables[n] = lowrank.matrix_table(rows, device, dense, rest)
        return hit

    def take_dense(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The dense parameters' values end to end (to ride behind the P's), as a list."""
        return [] if self.dense_idx is None else [x.index_select(0, self.dense_idx)]

    def put_dense(self, out: torch.Tensor, buf: torch.Tensor, W: int) -> None:
        """out[dense parameters] = their sum over ranks (behind the P's in buf) / W."""
        if self.dense_idx is not None:
            out.index_copy_(0, self.dense_idx, buf[self.p_total :].div_(W))

    def zero_dense(self, t: torch.Tensor) -> None:
        if self.dense_idx is not None:
            t.index_fill_(0, self.dense_idx, 0.0)


def _one_buffer(qs: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """The Q's ``qs`` (the memory's tensors, of ``sizes`` elements) as one flat buffer of
    which they are views, end to end: the storage they lie in where they lie so (every step
    after a bucket's first, no copy), else a new buffer they are moved into (``set_``: the
    same tensor objects, so the memory, the guard's restore and the checkpoint see them)."""
    first, at = qs[0], qs[0].storage_offset()
    ptr = first.untyped_storage().data_ptr()
    for v, k in zip(qs, sizes):
        if (v.untyped_storage().data_ptr() != ptr or v.storage_offset() != at
                or not v.is_contiguous()):
            break
        at += k
    else:
        return first.as_strided((at - first.storage_offset(),), (1,))
    q = torch.cat([v.view(-1) for v in qs])
    for v, part in zip(qs, q.split(sizes)):
        if v.is_cuda and torch.cuda.is_available():  # its old storage is not reused while
            # this stream's cat may read it
            v.record_stream(torch.cuda.current_stream(v.device))
        v.set_(q.untyped_storage(), part.storage_offset(), v.shape)
    return q


def _power_step(Ms, qs, dense, lay, ctx):
    """The CPU paths' power iteration on the groups' matrices Ms (B, n, m) with their warm
    starts qs: P = M Q, allreduced with the ``dense`` values (a list of tensors) behind it,
    orthonormalized in place; Q = M^T P, allreduced and kept in qs for the next step.
    Returns (the first message, the P's, the new Q's (B, m, r))."""
    Ps = [bmm(M, torch.stack(q)) for M, q in zip(Ms, qs)]
    # 1st collective: every P and every uncompressed tensor together
    buf = torch.cat([P.view(-1) for P in Ps] + dense)
    ctx.comm.allreduce(buf)
    # in place in buf (its P part is not read again)
    Ps = [orthonormalize(buf[a:b].view(P.shape)) for P, (a, b) in zip(Ps, lay.p_spans)]
    # 2nd collective: every Q
    qbuf = torch.cat([bmm(M.transpose(1, 2), P).view(-1) for M, P in zip(Ms, Ps)])
    ctx.comm.allreduce(qbuf)
    Qs = []
    for g, q, (a, b) in zip(lay.groups, qs, lay.q_spans):
        Qs.append(qbuf[a:b].view(g.B, g.m, g.r))
        torch._foreach_copy_(q, Qs[-1].unbind(0))
    return buf, Ps, Qs


def _averaged(Q: torch.Tensor, W: int) -> tuple[torch.Tensor, bool]:
    """(Q', scaled): Q / W where W is a power of two (scaled: P Q'^T is then P Q^T / W bit
    for bit, every product and sum scaled exactly, so the product needs no pass of its own
    to divide), else (Q, False). Q (B, m, r) is small; a subnormal result of P Q^T is the
    only place the two could differ."""
    if W == 1:
        return Q, True
    if W & (W - 1) == 0:
        return Q / W, True
    return Q, False


def orthonormalize(P: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns of each matrix of P (B, n, r), in place: Gram-Schmidt, as in the
    PowerSGD authors' code (epfml/powersgd, ``orthogonalize``) and torch's powerSGD_hook, but
    each column's projection on the columns before it is taken ``GS_PASSES`` (3) times
    (classical Gram-Schmidt with reorthogonalization), which keeps P orthonormal to float
    precision where one pass loses it (measured: a full-rank 64 x 64 P off by 1e-2 with one
    pass, 2e-7 with two; Householder QR 6e-7), and where two lose it: when M's rank is
    below r (see :data:`gradcomp.kernels.lowrank.GS_PASSES`). Each column is scaled to norm 1
    and gets a fixed fallback first, so that rounding noise and zero columns still come out
    as unit vectors (:data:`gradcomp.kernels.lowrank.FALLBACK_SCALE`).
    The dot products are bmm's, not ``sum(dim=1)``: a reduction's order depends on the
    batch (a batch of one is reduced as a whole tensor, measured to round differently at
    n = 65), a matrix product's does not (see the module docstring). These products have
    at most r in the inner or the outer dimension: plain ``torch.bmm`` and ``baddbmm_``
    give the same bits for any batch of two or more; a batch of one runs as a batch of two
    (measured on an Intel Xeon with torch 2.13: a batch of one rounds differently at
    n >= 1000, where an AMD EPYC did not; tested)."""
    if P.shape[0] == 1:  # a batch of one takes other BLAS paths on some CPUs (see bmm)
        return P.copy_(orthonormalize(P.expand(2, -1, -1).clone())[:1])
    # every column to norm 1 at once (the Gram matrix's diagonal), then the fallback
    norms = torch.bmm(P.transpose(1, 2), P).diagonal(dim1=1, dim2=2).sqrt().clamp_min_(1e-30)
    P.div_(norms.unsqueeze(1)).add_(lowrank.fallback(P.shape[1], P.shape[2], P.device),
                                    alpha=lowrank.FALLBACK_SCALE)
    for i in range(P.shape[2]):
        col = P[:, :, i : i + 1]
        if i:
            done = P[:, :, :i]
            done_t = done.transpose(1, 2)
            for _ in range(lowrank.GS_PASSES):
                col.baddbmm_(done, torch.bmm(done_t, col), alpha=-1)
        col.div_(torch.bmm(col.transpose(1, 2), col).sqrt_().clamp_min_(1e-30))
    return P


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` whose result for one matrix does not depend on the batch size: a
    batch of ONE matrix-vector product takes another BLAS path than a larger batch (other
    rounding; measured with torch 2.13/MKL, M Q at r = 1 for n m r >= 400), so it runs as a
    batch of two (the same operands twice, no copy) and keeps the first."""
    if a.shape[0] == 1:
        return torch.bmm(a.expand(2, -1, -1), b.expand(2, -1, -1))[:1]
    return torch.bmm(a, b)


def _init_q(seed: int, name: str, m: int, r: int, device) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(name_seed(seed, name))
    return _orthonormal(torch.randn(m, r, generator=g)).to(device)


def _orthonormal(a: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of a's columns (reduced QR), written back into a: the first Q, once
    per parameter (unchanged, so a run's start does not change across versions)."""
    if a.shape[1] == 1:
        return a.div_(a.norm() + 1e-12)
    q, _ = torch.linalg.qr(a)
    return a.copy_(q)
