"""Plain fp32 allreduce through gradcomp's hook: the baseline every method must match.

Sends every element as fp32 (4 bytes each). Use it to compare against, or with ``delay``
to hide latency without compressing.
"""
from __future__ import annotations

from .base import Compressor, register_method


@register_method
class AllReduce(Compressor):
    name = "allreduce"
    description = "uncompressed fp32 allreduce (baseline)"
    stateless = True  # inf/NaN simply propagate, as with DDP's own allreduce

    def reduce(self, x, ctx):
        return self.dense(x, ctx)
