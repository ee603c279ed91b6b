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

  * :func:`project`: P = M Q (one program per tile of ``TILE_ROWS`` rows of one matrix)
  * :func:`orthonormalize`: each P's columns orthonormal, in place (one program per matrix):
    classical Gram-Schmidt with one reorthogonalization, as in the compressor's CPU path
  * :func:`back`: Q = M^T P (one program per tile of ``TILE_COLS`` columns of one matrix)
  * :func:`expand`: out[matrix] = P Q^T / W (one program per row tile)

The functions below dispatch to the Triton kernels (CUDA tensors, or any tensor under
``GRADCOMP_KERNELS=triton``) and otherwise run the reference: the same arithmetic matrix by
matrix with torch, the specification the kernels are tested against. The two agree to float
tolerance, not bit for bit (a matrix product's summation order is the implementation's); each
is deterministic, and a matrix's result never depends on the other matrices of its table, so
a run resumes bit-exactly on the path it was checkpointed on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _triton_module, backend

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


def matrix_table(rows, device) -> MatrixTable:
    """The table of matrices ``rows`` ((x_off, n, m, r, p_off, q_off), ...)."""
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

    return MatrixTable(rows, t(rows, 6), t(row_tiles, 2), t(col_tiles, 2),
                       1 << (r_max - 1).bit_length())


def _kernels(t: torch.Tensor):
    return _triton_module() if backend("powersgd", t) == "triton" else None


def project(x: torch.Tensor, q: torch.Tensor, p: torch.Tensor, table: MatrixTable) -> torch.Tensor:
    """p[matrix k] = M_k Q_k for every matrix of the table; returns p."""
    tk = _kernels(x)
    if tk:
        return tk.powersgd_project(x, q, p, table)
    for x_off, n, m, r, p_off, q_off in table.rows:
        M = x[x_off : x_off + n * m].view(n, m).float()
        torch.mm(M, q[q_off : q_off + m * r].view(m, r), out=p[p_off : p_off + n * r].view(n, r))
    return p


def back(x: torch.Tensor, p: torch.Tensor, q: torch.Tensor, table: MatrixTable) -> torch.Tensor:
    """q[matrix k] = M_k^T P_k for every matrix of the table; returns q."""
    tk = _kernels(x)
    if tk:
        return tk.powersgd_back(x, p, q, table)
    for x_off, n, m, r, p_off, q_off in table.rows:
        M = x[x_off : x_off + n * m].view(n, m).float()
        torch.mm(M.t(), p[p_off : p_off + n * r].view(n, r), out=q[q_off : q_off + m * r].view(m, r))
    return q


def expand(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor, table: MatrixTable,
           W: int) -> torch.Tensor:
    """out[matrix k] = P_k Q_k^T / W for every matrix of the table (its other elements are
    left alone); returns out."""
    tk = _kernels(p)
    if tk:
        return tk.powersgd_expand(p, q, out, table, W)
    for x_off, n, m, r, p_off, q_off in table.rows:
        P, Q = p[p_off : p_off + n * r].view(n, r), q[q_off : q_off + m * r].view(m, r)
        out[x_off : x_off + n * m].view(n, m).copy_((P @ Q.t()).div_(W))
    return out


def orthonormalize(p: torch.Tensor, table: MatrixTable) -> torch.Tensor:
    """Each matrix's P with orthonormal columns, in place: for column i, its projection on
    columns 0..i-1 is subtracted twice (classical Gram-Schmidt with reorthogonalization),
    then it is divided by its norm + 1e-12. Returns p."""
    tk = _kernels(p)
    if tk:
        return tk.powersgd_orthonormalize(p, table)
    for _, n, _m, r, p_off, _ in table.rows:
        P = p[p_off : p_off + n * r].view(n, r)
        for i in range(r):
            col = P[:, i]
            for _ in range(2 if i else 0):
                col.sub_(P[:, :i] @ (P[:, :i].t() @ col))
            col.div_(col.dot(col).sqrt() + 1e-12)
    return p
