"""The primitives of hooking a user's optimizer, below the bindings that use them
(hooks/optimizer/): the torch optimizer inside a framework's wrapper, one pair of step hooks
per binding, a pre-hook's work deferred past a ``step(closure)``'s backward."""
from __future__ import annotations

import torch

ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW)


def unwrap(optimizer):
    """The torch optimizer inside a framework's wrapper: Accelerate's AcceleratedOptimizer
    (itself a torch.optim.Optimizer subclass) holds it as ``.optimizer``, Lightning's
    LightningOptimizer as ``._optimizer``. The hooks gradcomp puts on an optimizer go on this
    one, whose ``step()`` every wrapper ends in."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer or (
                isinstance(optimizer, torch.optim.Optimizer) and not hasattr(inner, "param_groups")):
            break
        optimizer = inner
    return optimizer


def is_adam(optimizer) -> bool:
    return isinstance(unwrap(optimizer), ADAM_TYPES)


def step_hooks(optimizer, key: str, pre, post) -> list:
    """``pre`` and ``post`` as step hooks of the torch optimizer (inside any framework's
    wrapper). A binding registered again (a resumed job's new state) replaces the hooks its
    predecessor left under the same ``key``: one pair per key and optimizer."""
    optimizer = unwrap(optimizer)
    attr = f"_gradcomp_{key}_hooks"
    for h in getattr(optimizer, attr, None) or ():
        h.remove()
    handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
    setattr(optimizer, attr, handles)
    return handles


def after_closure(args, kwargs, fn):
    """Run ``fn`` from an optimizer step pre-hook once the step's gradients exist. With
    ``step(closure)`` (Lightning's automatic optimization, LBFGS-style loops) the closure's
    backward runs inside ``step()``, after the pre-hooks: ``fn`` then runs when the closure
    returns, before the optimizer reads any gradient. Returns what the pre-hook returns (the
    step's new (args, kwargs), or None)."""
    args, kwargs = tuple(args or ()), dict(kwargs or {})  # args: (optimizer, closure?)
    closure, where = kwargs.get("closure"), "kwargs"
    if closure is None and len(args) > 1 and callable(args[1]):
        closure, where = args[1], "args"
    if closure is None:
        fn()
        return None

    def closure_then_fn():
        loss = closure()
        fn()
        return loss

    if where == "args":
        return (args[0], closure_then_fn, *args[2:]), kwargs
    return args, {**kwargs, "closure": closure_then_fn}


def learning_rates(optimizer) -> list[float]:
    """Each param group's learning rate."""
    return [g["lr"] for g in optimizer.param_groups]


def set_learning_rates(optimizer, lrs) -> None:
    """Each param group's learning rate set to ``lrs``' (in group order)."""
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
