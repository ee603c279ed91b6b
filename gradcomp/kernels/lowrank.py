"""PowerSGD's matrix steps over a whole bucket in a fixed number of launches (the GPU path).

On the CPU, :mod:`gradcomp.compressors.powersgd` batches a bucket's matrices by shape (one
``bmm`` per distinct shape), so its op count grows with the number of distinct shapes: a
CNN bucket has dozens. Here every matrix of a bucket is described once per layout by a
:class:`MatrixTable` (cached by the compressor), and each step is one Triton launch over all
of them, whatever their shapes: a program finds its matrix and its tile in the table
(grouped matrix products, as in grouped GEMM).

A table row is (x_off, n, m, r, p_off, q_off): matrix k is ``x[x_off : x_off + n m]`` viewed
n x m (row-major, the parameter's first dimension by the rest), its P is
``p[p_off : p_off + n r]`` viewed n x r and its Q is ``q[q_off : q_off + m r]`` viewed m x r.
The table also lists the bucket's other elements (``elems``): first the ``dense`` ones, sent
whole behind the P's (the j-th at ``p[dense_at + j]``), then those of no parameter.

With an error-feedback residual ``e`` (laid out as x) the matrices are M = x + e, added where
they are read (x is not written before :func:`expand`): the whole exchange is the four
launches below, the residual's update and the dense tensors' gather and average among them.

  * :func:`project`: P = M Q (one program per tile of ``TILE_ROWS`` rows of one matrix),
    the dense elements gathered behind the P's
  * :func:`orthonormalize`: each P's columns orthonormal, in place (one program per matrix):
    classical Gram-Schmidt, each projection taken ``GS_PASSES`` (3) times, as in the
    compressor's CPU path
  * :func:`back`: Q = M^T P (one program per tile of ``TILE_COLS`` columns of one matrix)
  * :func:`expand`: out[matrix] = P Q^T / W (one program per row tile), out[dense] = their
    sum times 1 / W, and the next residual M - out (0 at the dense elements)

The functions below dispatch to the Triton kernels (CUDA tensors, or any tensor under
``GRADCOMP_KERNELS=triton``) and otherwise run the reference: the same arithmetic matrix by
matrix with torch, the specification the kernels are tested against. The two agree to float
tolerance, not bit for bit (a matrix product's summation order is the implementation's); each
is deterministic, and a matrix's result never depends on the other matrices of its table, so
a run resumes bit-exactly on the path it was checkpointed on.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import implementation
from . import reference
from .reference import reciprocal

# How many times each Gram-Schmidt column's projection on the columns before it is
# subtracted, on every path (the CPU batch, this reference, the Triton kernel). Two passes
# ("twice is enough": Giraud, Langou, Rozloznik 2005) hold for a column that is not already
# in the span of the ones before it; a P whose matrix has rank below r has such columns
# (a batch smaller than r, a rank-1 gradient, a zero row block): after one pass they are
# rounding noise, and two more passes are "twice" for that noise. With two, measured: a
# rank-1 512 x 512 matrix at r = 16 came back 12x off (P^T P far from I); with three,
# within 7e-6 for every rank below r (tests/test_segmented_terngrad_powersgd.py).
GS_PASSES = 3
# Each column is first scaled to norm 1 (a zero column stays zero there), FALLBACK_SCALE times
# a fixed pseudo-random vector (:func:`fallback`) is added before the projections; the
# result is divided by its norm, clamped at 1e-30. A column that is rounding noise after its
# projections becomes a unit vector orthogonal to the columns before it, whatever M's
# scale: with an absolute ``+ 1e-12`` in the division instead, such columns of 1e-13 were
# left unnormalized, and the warm start (Q = M^T P) shrank them step after step, P no
# longer orthonormal (measured: P^T P off by 1, P Q^T off M by 8e-5 in 5 steps of a
# full-rank run). A ZERO column (M = 0 at a step: an unused layer, a gradient of zeros)
# becomes the fallback's direction instead of staying zero: with zero, Q's column was zero
# for good (P = M Q), and the matrix was never sent again, its gradients piling up in the
# residual. On a column of norm 1 the fallback is below float32's resolution.
FALLBACK_SCALE = 1e-12


def fallback_values(j: torch.Tensor, i: int) -> torch.Tensor:
    """The fallback vector of column i at rows j (int64): values in [-0.5, 0.5) from an
    integer hash, the same bits in torch and in the Triton kernel."""
    h = ((j + 1) * 2654435761 + (i + 1) * 2246822519) & 65535
    return h.to(torch.float32) / 65536.0 - 0.5


@functools.lru_cache(maxsize=64)
def fallback(n: int, r: int, device) -> torch.Tensor:
    """(n, r) float32: column i is :func:`fallback_values` of rows 0..n-1. Cached per
    shape and device, shared by every caller: read only."""
    j = torch.arange(n, dtype=torch.int64, device=device)
    return torch.stack([fallback_values(j, i) for i in range(r)], dim=1)


# Tile of a matrix per program: rows for project/expand, columns for back (powers of two).
TILE_ROWS = 32
TILE_COLS = 64


@dataclass(frozen=True)
class MatrixTable:
    """A bucket's compressed matrices (host rows and device tables; built once per layout)."""

    rows: tuple               # ((x_off, n, m, r, p_off, q_off), ...)
    mats: torch.Tensor        # (K, 6) int64: the rows
    row_tiles: torch.Tensor   # (T, 2) int64: (matrix, first row) of each row tile
    col_tiles: torch.Tensor   # (U, 2) int64: (matrix, first column) of each column tile
    rank: int                 # the largest r, rounded up to a power of two (>= 1)
    tile_rows: int            # rows of a row tile (the kernels read the table's own)
    tile_cols: int            # columns of a column tile
    elems: torch.Tensor       # (E,) int64: places in x of the elements outside the matrices:
    dense: int                # the first ``dense`` of them sent whole, the j-th at
    dense_at: int             # p[dense_at + j] (behind every P); the rest in no parameter
    covered: int              # elements of x in a matrix or in elems


def matrix_table(rows, device, dense=(), rest=()) -> MatrixTable:
    """The table of matrices ``rows`` ((x_off, n, m, r, p_off, q_off), ...); ``dense`` and
    ``rest``: runs (offset, numel) of x sent whole, in their order behind the P's, and of
    elements in no parameter."""
    rows = tuple(tuple(int(v) for v in row) for row in rows)
    for row in rows:
        if len(row) != 6 or min(row[1:4]) < 1 or min(row) < 0:
            raise ValueError(f"a matrix table row is (x_off, n, m, r, p_off, q_off) with n, m, "
                             f"r >= 1, got {row}")
    row_tiles = [(k, a) for k, (_, n, *_r) in enumerate(rows) for a in range(0, n, TILE_ROWS)]
    col_tiles = [(k, c) for k, (_, _n, m, *_r) in enumerate(rows) for c in range(0, m, TILE_COLS)]
    r_max = max((row[3] for row in rows), default=1)

    def t(v, width):
        return torch.tensor(v, dtype=torch.int64, device=device).view(-1, width)

    runs = [(int(a), int(k)) for a, k in list(dense) + list(rest) if k]
    elems = (torch.cat([torch.arange(a, a + k, device=device) for a, k in runs]) if runs
             else torch.zeros(0, dtype=torch.int64, device=device))
    return MatrixTable(rows, t(rows, 6), t(row_tiles, 2), t(col_tiles, 2),
                       1 << (r_max - 1).bit_length(), TILE_ROWS, TILE_COLS, elems,
                       sum(int(k) for _, k in dense),
                       max((p_off + n * r for _, n, _m, r, p_off, _q in rows), default=0),
                       sum(n * m for _, n, m, *_r in rows) + elems.numel())


def project(x: torch.Tensor, q: torch.Tensor, p: torch.Tensor, table: MatrixTable,
            e: torch.Tensor | None = None) -> torch.Tensor:
    """p[matrix k] = M_k Q_k for every matrix of the table, and behind the P's the dense
    elements' M (M = x, or x + e with a residual e laid out as x); returns p."""
    return implementation("powersgd_project", x, reference_fn=_project)(x, q, p, table, e)


def _matrices(x, e, x_off, n, m):
    M = x[x_off : x_off + n * m]
    if e is not None:
        M = M + e[x_off : x_off + n * m]
    return M.view(n, m).float()


def _project(x, q, p, table, e=None):
    for x_off, n, m, r, p_off, q_off in table.rows:
        torch.mm(_matrices(x, e, x_off, n, m), q[q_off : q_off + m * r].view(m, r),
                 out=p[p_off : p_off + n * r].view(n, r))
    if table.dense:
        idx = table.elems[: table.dense]
        v = x[idx] if e is None else x[idx] + e[idx]
        p[table.dense_at : table.dense_at + table.dense] = v
    return p


def back(x: torch.Tensor, p: torch.Tensor, q: torch.Tensor, table: MatrixTable,
         e: torch.Tensor | None = None) -> torch.Tensor:
    """q[matrix k] = M_k^T P_k for every matrix of the table (M as in :func:`project`);
    returns q."""
    return implementation("powersgd_back", x, reference_fn=_back)(x, p, q, table, e)


def _back(x, p, q, table, e=None):
    for x_off, n, m, r, p_off, q_off in table.rows:
        torch.mm(_matrices(x, e, x_off, n, m).t(), p[p_off : p_off + n * r].view(n, r),
                 out=q[q_off : q_off + m * r].view(m, r))
    return q


def expand(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor, table: MatrixTable, W: int,
           e: torch.Tensor | None = None, e_next: torch.Tensor | None = None,
           verdict: tuple | None = None) -> torch.Tensor:
    """out[matrix k] = P_k Q_k^T / W for every matrix of the table, out[dense] = the dense
    elements behind the P's times 1 / W (the float32 reciprocal: what CUDA's ``div_`` by a
    number computes); with a residual e, out holds x before (M = x + e) and
    e_next = M - out (0 at the dense elements; e_next may be e), and out = M at the elements
    of no parameter; without, those are left alone. With the guard's ``verdict`` (flag,
    clear), for a table that covers out (every element in a matrix or in elems): then, as
    :func:`gradcomp.kernels.reference.flag_fill` (out NaN throughout where flag[0] > 0,
    clear[0] = 0), in the same launch. Returns out."""
    if verdict is not None and table.covered != out.numel():
        raise ValueError(f"expand writes the guard's verdict only where its table covers out "
                         f"({table.covered} of {out.numel()} elements)")
    return implementation("powersgd_expand", p, reference_fn=_expand)(p, q, out, table, W,
                                                                      e, e_next, verdict)


def _expand(p, q, out, table, W, e=None, e_next=None, verdict=None):
    _expand_values(p, q, out, table, W, e, e_next)
    if verdict is not None:
        reference.flag_fill(out, *verdict)
    return out


def _expand_values(p, q, out, table, W, e, e_next):
    for x_off, n, m, r, p_off, q_off in table.rows:
        P, Q = p[p_off : p_off + n * r].view(n, r), q[q_off : q_off + m * r].view(m, r)
        sl = slice(x_off, x_off + n * m)
        v = (P @ Q.t()).div_(W).view(-1)
        if e is not None:
            e_next[sl] = (out[sl] + e[sl]) - v
        out[sl] = v
    idx, d = table.elems, table.dense
    if d:
        out[idx[:d]] = p[table.dense_at : table.dense_at + d] * reciprocal(W)
    if e is not None and len(idx):
        e_next[idx[:d]] = 0.0
        m = out[idx[d:]] + e[idx[d:]]
        out[idx[d:]] = m
        e_next[idx[d:]] = m - m
    return out


def orthonormalize(p: torch.Tensor, table: MatrixTable) -> torch.Tensor:
    """Each matrix's P with orthonormal columns, in place: for column i, its projection on
    columns 0..i-1 is subtracted ``GS_PASSES`` times (classical Gram-Schmidt with
    reorthogonalization), before that it is scaled to norm 1 and gets the fallback (see
    ``FALLBACK_SCALE``), after that it is divided by its norm. Returns p."""
    return implementation("powersgd_orthonormalize", p, reference_fn=_orthonormalize)(
        p, table, GS_PASSES, FALLBACK_SCALE)


def _orthonormalize(p, table, passes, fallback_scale):
    for _, n, _m, r, p_off, _ in table.rows:
        P = p[p_off : p_off + n * r].view(n, r)
        f = fallback(n, r, p.device)
        for i in range(r):
            col = P[:, i]
            col.div_(col.dot(col).sqrt().clamp_min(1e-30)).add_(f[:, i], alpha=fallback_scale)
            for _ in range(passes if i else 0):
                col.sub_(P[:, :i] @ (P[:, :i].t() @ col))
            col.div_(col.dot(col).sqrt().clamp_min(1e-30))
    return p
