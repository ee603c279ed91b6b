"""Small host values (a step's per-parameter seeds and shifts, a flag's step index) onto the
device without a host wait: on CUDA through pinned memory and a non-blocking copy (a copy from
pageable memory makes the host wait for the stream), elsewhere as they are."""
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
