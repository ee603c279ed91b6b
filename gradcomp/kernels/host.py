"""Small values between host and device without a host wait: a step's per-parameter seeds and
shifts onto the device (:func:`to_device`), a flag back to the host to be read later
(:func:`to_host_later`, :func:`read_later`). On CUDA through pinned memory and non-blocking
copies (a copy from or to pageable memory makes the host wait for the stream), elsewhere as
they are."""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, issued without a host wait. The
    pinned staging tensor stays reserved until its copy has run (torch's pinned allocator
    records the copy's stream)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_host_later(t: torch.Tensor):
    """Start copying a small tensor to the host; :func:`read_later` gives its values. On CUDA
    a pinned copy and an event after it (nothing waits now); elsewhere the tensor itself."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def read_later(pair) -> list:
    """The values of a :func:`to_host_later` copy (waiting for its event only if the device
    has not reached it yet: read a step later, it has)."""
    host, done = pair
    if done is not None and not done.query():
        done.synchronize()
    return host.tolist()
