"""Per-parameter chunks of a flat bucket: each parameter cut into rows of ``c`` elements
from its own first element (its last row padded), so a row never holds two parameters and a
parameter's rows do not depend on its neighbours in the bucket. One gather lays every row of
a bucket out as a (rows, c) matrix; one scatter puts them back. The plan is built once per
layout (cached)."""
from __future__ import annotations

import functools

import torch


class ChunkPlan:
    """``gather``: (rows * c,) int64 positions in the bucket extended by one zero element
    (index ``n``: the padding); ``valid``: (rows, c) bool, False at the padding;
    ``flat_rows``: the positions of the valid elements in the (rows * c) matrix, in bucket
    order of ``layout``; ``flat_src``: the same elements' positions in the bucket."""

    def __init__(self, layout: tuple, n: int, c: int, device):
        idx = []
        for off, numel in layout:
            rows = -(-numel // c)
            pos = torch.arange(rows * c, dtype=torch.int64)
            pos = torch.where(pos < numel, pos + off, torch.full_like(pos, n))
            idx.append(pos)
        self.c = c
        self.gather = (torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)).to(device)
        self.rows = self.gather.numel() // c
        self.valid = (self.gather != n).view(self.rows, c)
        self.flat_rows = self.valid.reshape(-1).nonzero().reshape(-1)
        self.flat_src = self.gather[self.flat_rows]

    def rows_of(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, c) copy of x's elements in the plan's layout, 0 at the padding."""
        ext = torch.cat([x, x.new_zeros(1)])
        return ext.index_select(0, self.gather).view(self.rows, self.c)

    def put(self, m: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[elements of the layout] = the valid elements of m (rows, c)."""
        out.index_copy_(0, self.flat_src, m.reshape(-1).index_select(0, self.flat_rows))
        return out


@functools.lru_cache(maxsize=256)
def chunk_plan(layout: tuple, n: int, c: int, device) -> ChunkPlan:
    """The cached :class:`ChunkPlan` of ``layout`` ((offset, numel) pairs) in a bucket of
    ``n`` elements, rows of ``c``."""
    return ChunkPlan(layout, n, c, torch.device(device))
