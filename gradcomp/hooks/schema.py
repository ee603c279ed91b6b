"""The checks a checkpoint's parts go through before anything is loaded (hooks/checkpoint.py,
and each component's own part: hooks/local_steps.py's rounds): each raises a ValueError
naming the part, what it holds and what is allowed."""
from __future__ import annotations

import torch

from ..config import MAX_STEPS, quote


def bad(what: str, value, allowed: str) -> ValueError:
    return ValueError(f"gradcomp checkpoint: {what} is {quote(value)}; allowed {allowed}")


def check_int(what, v, low=0, high=MAX_STEPS):
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise bad(what, v, f"an integer in [{low}, {high}]")


def check_tensor(what, t, numel=None):
    if not isinstance(t, torch.Tensor):
        raise bad(what, type(t).__name__, "a tensor")
    if t.layout != torch.strided or t.is_meta or type(t) is not torch.Tensor:
        raise bad(what, f"a {type(t).__name__} ({t.layout}, {t.device})",
                  "a dense torch.Tensor holding values")
    if not t.dtype.is_floating_point:
        raise bad(f"{what}'s dtype", t.dtype, "a floating-point dtype")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"gradcomp checkpoint: {what} holds {t.numel()} elements; this model's "
                         f"parameter has {numel}")
    if not bool(torch.isfinite(t).all()):
        raise bad(what, "a tensor holding inf/NaN", "finite values")


def check_plain(what, v):
    """A value of the saved config: None, a bool, a number or a string (compared as such)."""
    if not isinstance(v, (type(None), bool, int, float, str)):
        raise bad(what, type(v).__name__, "None, a bool, a number or a string")


def check_names(what, d) -> None:
    if not isinstance(d, dict):
        raise bad(what, type(d).__name__, "a dict by parameter name")
    for name in d:
        if not isinstance(name, str):
            raise bad(f"a key of {what}", name, "a parameter name (a string)")
