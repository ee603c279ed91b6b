"""PowerSGD's Triton kernels (compressors/powersgd.py): the matrix steps over a table of
matrices of any shapes, as kernels/lowrank.py's loops specify them."""
from __future__ import annotations

import triton
import triton.language as tl

from ..reference import check_clear, check_guard, reciprocal
from . import common as c


# --------------------------------------------------------------------------- PowerSGD matrices
# Grouped matrix steps over a table of matrices of any shapes (see :mod:`.lowrank`, whose
# reference they match to float tolerance): one launch per step for a whole bucket. r is at
# most a few: the products are broadcast multiply-adds over a (rows, cols, R) tile, not
# tl.dot (no tf32, no minimum tile of 16 on the rank's side).
@triton.jit
def _psgd_tile(mats_ptr, tiles_ptr):
    """This program's tile: (its first row or column, then its matrix's table row)."""
    t = tl.program_id(0)
    row = mats_ptr + 6 * tl.load(tiles_ptr + 2 * t)
    return (tl.load(tiles_ptr + 2 * t + 1), tl.load(row), tl.load(row + 1), tl.load(row + 2),
            tl.load(row + 3), tl.load(row + 4), tl.load(row + 5))


@triton.jit
def _psgd_row_tile(mats_ptr, tiles_ptr, BN: tl.constexpr, R: tl.constexpr):
    """A row tile's matrix (:func:`_psgd_tile`: its place in x, n, m, r and its P's and Q's
    places), the tile's BN rows and the R rank columns, with their masks."""
    first, x_off, n, m, r, p_off, q_off = _psgd_tile(mats_ptr, tiles_ptr)
    rows = first + tl.arange(0, BN)
    js = tl.arange(0, R)
    return x_off, m, r, p_off, q_off, rows, js, rows < n, js < r


@triton.jit
def _psgd_matrix(x_ptr, e_ptr, x_off, rows, cols, m, mask, HAS_E: tl.constexpr):
    """A block of a matrix M: x's, plus the residual's (laid out as x) with HAS_E."""
    a = tl.load(x_ptr + x_off + rows[:, None] * m + cols[None, :], mask=mask, other=0.0)
    a = a.to(tl.float32)
    if HAS_E:
        a += tl.load(e_ptr + x_off + rows[:, None] * m + cols[None, :], mask=mask, other=0.0)
    return a


@triton.jit
def _psgd_project_kernel(
    x_ptr,      # bucket, fp32/fp16/bf16                reads each matrix once, each dense
    e_ptr,      # residual, fp32, laid out as x (read with HAS_E)   element once
    q_ptr,      # Q's, fp32                             reads m r per row tile
    p_ptr,      # P's, fp32                             writes n r, then the dense elements
    mats_ptr,   # (K, 6) int64 table
    tiles_ptr,  # (T, 2) int64 (matrix, first row)
    elems_ptr,  # (>= D,) int64: the dense elements' places in x, the j-th to p[dense_at + j]
    T, D, dense_at,  # programs from T on gather the dense elements, BLOCK each
    BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, HAS_E: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if tl.program_id(0) < T:
        x_off, m, r, p_off, q_off, rows, js, rmask, jmask = _psgd_row_tile(mats_ptr, tiles_ptr,
                                                                          BN, R)
        acc = tl.zeros((BN, R), tl.float32)
        for c0 in range(0, m, BK):
            cols = c0 + tl.arange(0, BK)
            cmask = cols < m
            a = _psgd_matrix(x_ptr, e_ptr, x_off, rows, cols, m,
                             rmask[:, None] & cmask[None, :], HAS_E)
            b = tl.load(q_ptr + q_off + cols[:, None] * r + js[None, :],
                        mask=cmask[:, None] & jmask[None, :], other=0.0)
            acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
        tl.store(p_ptr + p_off + rows[:, None] * r + js[None, :], acc,
                 mask=rmask[:, None] & jmask[None, :])
    else:
        j = (tl.program_id(0) - T).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        jm = j < D
        i = tl.load(elems_ptr + j, mask=jm, other=0)
        v = tl.load(x_ptr + i, mask=jm, other=0.0).to(tl.float32)
        if HAS_E:
            v += tl.load(e_ptr + i, mask=jm, other=0.0)
        tl.store(p_ptr + dense_at + j, v, mask=jm)


@triton.jit
def _psgd_back_kernel(
    x_ptr,      # bucket                                reads each matrix once
    e_ptr,      # residual laid out as x (with HAS_E)   reads each matrix once
    p_ptr,      # P's, fp32                             reads n r per column tile
    q_ptr,      # Q's, fp32                             writes m r
    mats_ptr, tiles_ptr,  # (U, 2) int64 (matrix, first column)
    BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, HAS_E: tl.constexpr,
):
    first, x_off, n, m, r, p_off, q_off = _psgd_tile(mats_ptr, tiles_ptr)
    cols = first + tl.arange(0, BK)
    js = tl.arange(0, R)
    cmask, jmask = cols < m, js < r
    acc = tl.zeros((BK, R), tl.float32)
    for r0 in range(0, n, BN):
        rows = r0 + tl.arange(0, BN)
        rmask = rows < n
        a = _psgd_matrix(x_ptr, e_ptr, x_off, rows, cols, m, rmask[:, None] & cmask[None, :],
                         HAS_E)
        b = tl.load(p_ptr + p_off + rows[:, None] * r + js[None, :],
                    mask=rmask[:, None] & jmask[None, :], other=0.0)
        acc += tl.sum(a[:, :, None] * b[:, None, :], axis=0)
    tl.store(q_ptr + q_off + cols[:, None] * r + js[None, :], acc,
             mask=cmask[:, None] & jmask[None, :])


@triton.jit
def _psgd_expand_kernel(
    p_ptr, q_ptr,  # P's and Q's, fp32; behind the P's the dense elements' sums
    out_ptr,       # bucket: each matrix and dense element written once (in out's dtype);
                   # with HAS_E it holds x before, read once where written
    e_ptr,         # residual (M = x + e), fp32, laid out as x: read with HAS_E
    en_ptr,        # next residual, fp32 (may be e): M - out, written with HAS_E
    mats_ptr, tiles_ptr,  # row tiles, as project
    elems_ptr,     # (E,) int64: the dense elements' places, then those of no parameter
    flag_ptr,      # fp32, the guard's flag: out NaN throughout where [0] > 0 (HAS_FLAG)
    clear_ptr,     # fp32, the guard's other flag: [0] = 0 by program 0 (HAS_FLAG)
    T, D, E, dense_at,  # programs from T on take E elements (D with neither HAS_E nor
                        # HAS_FLAG), BLOCK each
    W, INV_W,      # the divisor of P Q^T; 1 / W in float32, the dense sums' factor
    BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, HAS_E: tl.constexpr,
    HAS_FLAG: tl.constexpr, BLOCK: tl.constexpr,
):
    if HAS_FLAG:
        up = tl.load(flag_ptr) > 0
        if tl.program_id(0) == 0:
            tl.store(clear_ptr, 0.0)
    if tl.program_id(0) < T:
        x_off, m, r, p_off, q_off, rows, js, rmask, jmask = _psgd_row_tile(mats_ptr, tiles_ptr,
                                                                          BN, R)
        a = tl.load(p_ptr + p_off + rows[:, None] * r + js[None, :],
                    mask=rmask[:, None] & jmask[None, :], other=0.0)
        for c0 in range(0, m, BK):
            cols = c0 + tl.arange(0, BK)
            cmask = cols < m
            mask = rmask[:, None] & cmask[None, :]
            b = tl.load(q_ptr + q_off + cols[:, None] * r + js[None, :],
                        mask=cmask[:, None] & jmask[None, :], other=0.0)
            v = (tl.sum(a[:, None, :] * b[None, :, :], axis=2) / W).to(out_ptr.dtype.element_ty)
            if HAS_E:
                M = _psgd_matrix(out_ptr, e_ptr, x_off, rows, cols, m, mask, True)
                tl.store(en_ptr + x_off + rows[:, None] * m + cols[None, :],
                         M - v.to(tl.float32), mask=mask)
            if HAS_FLAG:
                v = tl.where(up, float("nan"), v.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + x_off + rows[:, None] * m + cols[None, :], v, mask=mask)
    else:
        j = (tl.program_id(0) - T).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        jm, dense = j < E, j < D
        i = tl.load(elems_ptr + j, mask=jm, other=0)
        v = tl.load(p_ptr + dense_at + j, mask=dense, other=0.0) * INV_W
        if HAS_E:  # elements of no parameter: out = M, and M - M left behind
            M = (tl.load(out_ptr + i, mask=jm & ~dense, other=0.0).to(tl.float32)
                 + tl.load(e_ptr + i, mask=jm & ~dense, other=0.0))
            v = tl.where(dense, v, M)
            tl.store(en_ptr + i, tl.where(dense, 0.0, M - M), mask=jm)
        elif HAS_FLAG:  # elements of no parameter: out as it is (unless flagged)
            v = tl.where(dense, v, tl.load(out_ptr + i, mask=jm & ~dense, other=0.0).to(tl.float32))
        if HAS_FLAG:
            v = tl.where(up, float("nan"), v)
        tl.store(out_ptr + i, v.to(out_ptr.dtype.element_ty), mask=jm)


@triton.jit
def _psgd_orthonormalize_kernel(
    p_ptr,     # P's, fp32, in place: each read PASSES (r - 1) + 4 times per column
    mats_ptr,
    FALLBACK: tl.constexpr,
    BN: tl.constexpr, R: tl.constexpr, PASSES: tl.constexpr,
):
    row = mats_ptr + 6 * tl.program_id(0)
    n, r, p_off = tl.load(row + 1), tl.load(row + 3), tl.load(row + 4)
    js = tl.arange(0, R)
    jmask = js < r
    base = p_ptr + p_off
    for i in range(0, r):
        _psgd_unit_column(base, i, n, r, FALLBACK, BN, True)  # norm 1, plus the fallback
        for _ in range(0, PASSES):  # the projection, PASSES times (at i = 0 it is zero)
            dots = tl.zeros((R,), tl.float32)  # dots[j] = P[:, j] . P[:, i]
            for r0 in range(0, n, BN):
                rows = r0 + tl.arange(0, BN)
                blk = tl.load(base + rows[:, None] * r + js[None, :],
                              mask=(rows < n)[:, None] & jmask[None, :], other=0.0)
                col = tl.sum(tl.where(js[None, :] == i, blk, 0.0), axis=1)
                dots += tl.sum(blk * col[:, None], axis=0)
            dots = tl.where(js < i, dots, 0.0)
            tl.debug_barrier()
            for r0 in range(0, n, BN):
                rows = r0 + tl.arange(0, BN)
                rmask = rows < n
                blk = tl.load(base + rows[:, None] * r + js[None, :],
                              mask=rmask[:, None] & jmask[None, :], other=0.0)
                col = tl.sum(tl.where(js[None, :] == i, blk, 0.0), axis=1)
                tl.store(base + rows * r + i, col - tl.sum(blk * dots[None, :], axis=1),
                         mask=rmask)
            tl.debug_barrier()
        _psgd_unit_column(base, i, n, r, FALLBACK, BN, False)


@triton.jit
def _psgd_unit_column(base, i, n, r, FALLBACK: tl.constexpr, BN: tl.constexpr,
                      ADD: tl.constexpr):
    """Column i of an n x r P divided by its norm (clamped at 1e-30), plus (ADD) FALLBACK
    times :func:`gradcomp.kernels.lowrank.fallback_values`: its integer hash, whose low 16
    bits are the same at any integer width."""
    ss = tl.zeros((BN,), tl.float32)
    for r0 in range(0, n, BN):
        rows = r0 + tl.arange(0, BN)
        col = tl.load(base + rows * r + i, mask=rows < n, other=0.0)
        ss += col * col
    norm = tl.maximum(tl.sqrt(tl.sum(ss, axis=0)), 1e-30)
    for r0 in range(0, n, BN):
        rows = r0 + tl.arange(0, BN)
        col = tl.load(base + rows * r + i, mask=rows < n, other=0.0) / norm
        if ADD:
            h = ((rows.to(tl.int64) + 1) * 2654435761 + (i + 1) * 2246822519) & 65535
            col += FALLBACK * (h.to(tl.float32) / 65536.0 - 0.5)
        tl.store(base + rows * r + i, col, mask=rows < n)
    tl.debug_barrier()


def _check_table(table, *ts):
    for t in ts:
        c.check_flat(t, "buffer")
    if table.mats.device != ts[0].device:
        raise ValueError(f"the matrix table is on {table.mats.device}, the buffers on "
                         f"{ts[0].device}")


def _element_programs(n):
    return triton.cdiv(n, c.BLOCK)


def _check_residual(x, *es):
    for e in es:
        if e is not None:
            c.check_fp32(e, "residual", x.numel())


def powersgd_project(x, q, p, table, e=None):
    """See :func:`gradcomp.kernels.lowrank.project`: one launch."""
    _check_table(table, x, q, p)
    _check_residual(x, e)
    T = table.row_tiles.shape[0]
    if T + table.dense:
        _psgd_project_kernel[(T + _element_programs(table.dense),)](
            x, x if e is None else e, q, p, table.mats, table.row_tiles, table.elems, T,
            table.dense, table.dense_at, BN=table.tile_rows, BK=table.tile_cols, R=table.rank,
            HAS_E=e is not None, BLOCK=c.BLOCK, num_warps=c.NUM_WARPS)
    return p


def powersgd_back(x, p, q, table, e=None):
    """See :func:`gradcomp.kernels.lowrank.back`: one launch."""
    _check_table(table, x, p, q)
    _check_residual(x, e)
    if table.rows:
        _psgd_back_kernel[(table.col_tiles.shape[0],)](
            x, x if e is None else e, p, q, table.mats, table.col_tiles, BN=table.tile_rows,
            BK=table.tile_cols, R=table.rank, HAS_E=e is not None, num_warps=c.NUM_WARPS)
    return q


def powersgd_expand(p, q, out, table, W, e=None, e_next=None, verdict=None):
    """See :func:`gradcomp.kernels.lowrank.expand`: one launch (the guard's verdict in it:
    the table covers every element of out)."""
    _check_table(table, p, q, out)
    if (e is None) != (e_next is None):
        raise ValueError("expand takes the residual and the next residual together")
    _check_residual(out, e, e_next)
    flag, clear = (out, out) if verdict is None else verdict
    if verdict is not None:
        check_guard(out, flag, x_name="out")
        check_clear(flag, clear)
    T = table.row_tiles.shape[0]
    E = table.elems.numel() if e is not None or verdict is not None else table.dense
    if T + E or verdict is not None:
        _psgd_expand_kernel[(max(T + _element_programs(E), 1),)](
            p, q, out, out if e is None else e, out if e_next is None else e_next, table.mats,
            table.row_tiles, table.elems, flag, clear, T, table.dense, E, table.dense_at,
            float(W), reciprocal(W), BN=table.tile_rows, BK=table.tile_cols, R=table.rank,
            HAS_E=e is not None, HAS_FLAG=verdict is not None, BLOCK=c.BLOCK,
            num_warps=c.NUM_WARPS)
    return out


def powersgd_orthonormalize(p, table, passes, fallback):
    """See :func:`gradcomp.kernels.lowrank.orthonormalize`: one launch, a program per
    matrix."""
    _check_table(table, p)
    if table.rows:
        _psgd_orthonormalize_kernel[(len(table.rows),)](
            p, table.mats, fallback, BN=4 * table.tile_rows, R=table.rank, PASSES=passes,
            num_warps=c.NUM_WARPS)
    return p
