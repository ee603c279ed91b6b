"""Small values between host and device without a host wait: a step's per-parameter seeds and
shifts onto the device (:func:`to_device`), a flag back to the host to be read later
(:func:`to_host_later`, :func:`read_later`, into a numpy array: host memory). On CUDA through
pinned memory and non-blocking copies (a copy from or to pageable memory makes the host wait
for the stream), elsewhere as they are."""
from __future__ import annotations

import numpy
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
    """Start copying a small tensor into host memory; :func:`read_later` gives its values. The
    destination is a numpy array: what is read later is host memory, never a tensor. On CUDA
    it is pinned, filled by a non-blocking copy with an event after it (nothing waits now);
    elsewhere the copy is made at once."""
    if t.device.type != "cuda":
        host = numpy.empty(tuple(t.shape), dtype=_NUMPY[t.dtype])
        torch.from_numpy(host).copy_(t)
        return host, None
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    # a view of the pinned memory (a host tensor: no device read); it keeps the memory alive
    return pinned.numpy(), done


def read_later(pair) -> list:
    """The values of a :func:`to_host_later` copy (waiting for its event only if the device
    has not reached it yet: read a step later, it has)."""
    host, done = pair
    if done is not None and not done.query():
        done.synchronize()
    return host.tolist()


_NUMPY = {torch.float32: numpy.float32, torch.float64: numpy.float64, torch.int64: numpy.int64,
          torch.int32: numpy.int32, torch.uint8: numpy.uint8, torch.bool: numpy.bool_}
