"""Reused CPU work buffers for temporaries that live inside one exchange (the kernels' and
the compressors')."""
from __future__ import annotations

import threading

import torch

_scratch = threading.local()


def scratch(key: str, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized (n,) work buffer for a temporary that lives only inside one
    exchange: on the CPU reused per thread and ``key`` (grown to the largest n asked for),
    elsewhere a fresh tensor (the CUDA caching allocator already reuses memory).

    Why: a fresh CPU tensor of a bucket's size is mmap'ed memory, and its first write pays a
    page fault per 4 KB page: 11M fp32 elements cost ~36 ms more fresh than reused (1
    thread), about as much as the op itself, and an exchange makes several. Each lane
    thread runs one exchange at a time, so a thread's buffers are never in use twice; a
    caller must not return such a buffer or keep it past the exchange."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(n, dtype=dtype, device=device)
    bufs = _scratch.__dict__.setdefault("bufs", {})
    t = bufs.get((key, dtype))
    if t is None or t.numel() < n:
        t = bufs[(key, dtype)] = torch.empty(n, dtype=dtype)
    return t[:n]
