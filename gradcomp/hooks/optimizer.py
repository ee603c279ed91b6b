"""What gradcomp does to a user's optimizer, in one place.

Adam and AdamW with compressed gradients (:class:`FrozenVariance`). Error feedback makes the
*sum* over steps of the compressed gradients equal the sum of the true ones, which is all a
linear update (SGD with momentum) needs. Adam is not linear in the gradient: its second
moment v averages the squares of what it receives, and the squares of compressed gradients
are not the squares of gradients. Top-k at 5% hands each coordinate a burst about 20 times
its gradient one step in 20 (v grows ~20x, the step shrinks ~4.5x); 1-bit hands every
coordinate of a 256-element chunk the chunk's mean magnitude (v loses the per-coordinate
scale Adam exists for). Measured on the GPT of bench/RESULTS.md, every method at its
defaults ended 0.10-0.31 nats above allreduce.

The cure of 1-bit Adam (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
with Adam's Convergence Speed", ICML 2021, arXiv:2102.02888): v settles early in training, so
learn it during a dense warm-up and freeze it once compression starts. With v fixed, Adam's
update is m / sqrt(v): linear in the gradients again, and error feedback works as it does for
momentum SGD. Here, per parameter the method compresses:

  1. During the warm-up (dense steps: the adaptive warm-up's, or ``dense_steps``) the
     optimizer runs untouched: v is learned from exact averaged gradients.
  2. At the parameter's first compressed step its Adam state is frozen: v stays as it is,
     with the bias correction of that step (``1 - beta2**k``, k its Adam step count then,
     kept in the optimizer's own state as ``gradcomp_frozen_step``: it travels with the
     optimizer's checkpoint).
  3. Every compressed step, from the optimizer's step pre-hook, with the group's current
     lr, betas, eps and weight decay (schedulers are followed):
        AdamW: w *= 1 - lr wd     (Adam: g += wd w)
        m = beta1 m + (1 - beta1) g                   (the optimizer's own exp_avg)
        w -= lr / (1 - beta1**t) * m / (sqrt(v / (1 - beta2**k)) + eps)
     with g the compressed average (error feedback included) in ``p.grad``. The parameter's
     gradient is hidden from the optimizer for the rest of its ``step()`` (it skips
     parameters whose ``grad`` is None) and handed back by the post-hook.
Parameters the method sends uncompressed (below ``min_numel``, PowerSGD's vectors) keep the
optimizer's own update, v included: their gradients are exact averages.

``adam="freeze"`` is what ``"auto"`` runs with torch.optim.Adam/AdamW. ``adam="precondition"``
also compresses in the update's own scale, g / sqrt(v_hat) (:meth:`FrozenVariance.scale`), so
that the compression error is spread as Adam will apply it; measured on the GPT it was
0.007-0.014 nats worse than "freeze" for onebit, topk and powersgd (PowerSGD's low rank does
not survive the per-element scaling), so it is not the default. ``adam="off"`` leaves Adam to
see compressed gradients (the measured loss, kept for comparison).

What freezing costs by itself: ``topk:ratio=1`` (every element sent, v frozen at the
switch) ended the 2000-step GPT run at 1.6082 against allreduce's 1.6083 (bench/RESULTS.md).
"""
from __future__ import annotations

import torch

from ..compressors.base import unwrap_optimizer as unwrap

ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW)
# Measured with AdamW (bench/RESULTS.md section 8: the GPT, 2000 steps, every method at its
# defaults): validation loss above allreduce's, in percent. register() warns once when one
# of these runs at its defaults with Adam/AdamW, naming the method that held.
ADAM_GAP_PCT = {"onebit": 4.3, "topk": 3.7, "powersgd": 4.5, "threshold": 14.0, "dgc": 18.8}
ADAM_HELD = "terngrad"
# options that do not change what a method computes (a run with only these is "at defaults")
_NEUTRAL = {"seed", "topology", "local_size", "min_numel", "exact", "adam", "delay"}
_warned: set = set()
FROZEN_KEY = "gradcomp_frozen_step"  # in optimizer.state[p]: the Adam step v was frozen at


def warn_measured(method: str, config, optimizer, stacklevel: int = 3) -> None:
    """Once per method and process: a method whose measured defaults did not hold with
    Adam/AdamW, run at those defaults with Adam/AdamW (``stacklevel``: the user's call)."""
    if method not in ADAM_GAP_PCT or method in _warned or not is_adam(optimizer):
        return
    defaults = type(config)().to_dict()
    if any(v != defaults[k] for k, v in config.to_dict().items() if k not in _NEUTRAL):
        return  # the user chose other settings: not what was measured
    if config.adam == "off" or config.local_steps > 1:
        return
    _warned.add(method)
    import warnings
    warnings.warn(
        f"gradcomp: {method} at its defaults with {type(unwrap(optimizer)).__name__} ended "
        f"{ADAM_GAP_PCT[method]:.1f}% above allreduce's validation loss on our GPT workload "
        f"(2000 steps, bench/RESULTS.md section 8); {ADAM_HELD!r} held allreduce's loss "
        f"there at 7x fewer bytes: gradcomp.register(model, {ADAM_HELD!r}, optimizer=opt). "
        f"docs/adam.md says more.", UserWarning, stacklevel=stacklevel)


def is_adam(optimizer) -> bool:
    return isinstance(unwrap(optimizer), ADAM_TYPES)


def check_adam(optimizer) -> None:
    """Refuse the Adam settings the frozen-variance step does not reproduce."""
    for i, g in enumerate(unwrap(optimizer).param_groups):
        for key in ("capturable", "differentiable"):
            if g.get(key):
                raise ValueError(f"{key}=True in param group {i} of "
                                 f"{type(unwrap(optimizer)).__name__}: not supported with "
                                 f"compression (adam='freeze'); set {key}=False, or adam='off'")


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


class FrozenVariance:
    """Adam/AdamW with v frozen at the switch to compression, for the parameters the method
    compresses (module docstring). ``compressed(p)``: whether the method compresses
    parameter p; ``compressing()``: whether the gradients of the step about to be taken
    went compressed."""

    def __init__(self, optimizer, compressed, compressing, names: dict[int, str] | None = None,
                 precondition: bool = False):
        self.optimizer = unwrap(optimizer)
        self._compressing = compressing
        self._mine = {id(p) for g in self.optimizer.param_groups for p in g["params"]
                      if compressed(p)}
        self.precondition = precondition
        names = names or {}
        # name -> (parameter, its group) for the parameters this binding steps
        self._by_name = {names[id(p)]: (p, g) for g in self.optimizer.param_groups
                         for p in g["params"] if id(p) in self._mine and id(p) in names}
        self._scales: dict = {}  # bucket layout -> its preconditioner (constant once frozen)
        self._hidden: list = []
        old = getattr(self.optimizer, "_gradcomp_adam_hooks", None)
        for h in old or ():
            h.remove()  # a state registered again (a resumed job): one pair of hooks only
        self.handles = [self.optimizer.register_step_pre_hook(self._pre),
                        self.optimizer.register_step_post_hook(self._post)]
        self.optimizer._gradcomp_adam_hooks = self.handles

    def reset(self) -> None:
        """Forget the cached preconditioners: a loaded checkpoint (gradcomp's or the
        optimizer's) brings its own variance."""
        self._scales.clear()

    def close(self) -> None:
        self._post()
        for h in self.handles:
            h.remove()

    def _pre(self, optimizer=None, args=None, kwargs=None):
        self._post()  # a step() that raised never ran its post-hook
        return after_closure(args, kwargs, self._frozen_step)

    @torch.no_grad()
    def _frozen_step(self) -> None:
        if not self._compressing():
            return
        opt = self.optimizer
        decoupled = isinstance(opt, torch.optim.AdamW) or any(
            g.get("decoupled_weight_decay") for g in opt.param_groups)
        for group in opt.param_groups:
            params = [p for p in group["params"] if id(p) in self._mine and p.grad is not None
                      and opt.state.get(p)]  # no Adam state yet: the optimizer's own step
            if not params:
                continue
            self._step_group(group, params, decoupled or group.get("decoupled_weight_decay"))
            for p in params:
                self._hidden.append((p, p.grad))
                p.grad = None

    def _step_group(self, group, params, decoupled) -> None:
        opt = self.optimizer
        lr = float(group["lr"])
        beta1, beta2 = (float(b) for b in group["betas"])
        eps, wd = group["eps"], group["weight_decay"]
        grads = [p.grad for p in params]
        if group.get("maximize"):
            grads = torch._foreach_neg(grads)
        if wd and decoupled:
            torch._foreach_mul_(params, 1 - lr * wd)
        elif wd:
            grads = torch._foreach_add(grads, params, alpha=wd)
        states = [opt.state[p] for p in params]
        key = "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"
        ms, vs = [s["exp_avg"] for s in states], [s[key] for s in states]
        torch._foreach_lerp_(ms, [g.to(m.dtype) for g, m in zip(grads, ms)], 1 - beta1)
        step_sizes, v_scales = [], []
        for s in states:  # host scalars per parameter, not tensor work
            frozen = s.setdefault(FROZEN_KEY, int(s["step"]))
            s["step"] += 1
            t = int(s["step"])
            step_sizes.append(-lr / (1 - beta1 ** t))
            v_scales.append(1.0 / (1 - beta2 ** frozen) ** 0.5)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_mul_(denom, v_scales)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, ms, denom, step_sizes)

    def scale(self, params, device) -> torch.Tensor | None:
        """With ``precondition``: the bucket's per-element factor s = 1 / (sqrt(v_hat) + eps)
        of the frozen Adam variance (1 where the parameter is not compressed or has no Adam
        state yet), cached per layout: v no longer moves once frozen. The exchange then
        compresses g * s, the update's own scale (what Adam will apply), and returns
        average / s. None without ``precondition``. Built on the caller's thread at submit."""
        if not self.precondition:
            return None
        key = (tuple((p.name, p.offset, p.numel) for p in params), str(device))
        hit = self._scales.get(key)
        if hit is not None:
            return hit
        n = max((p.offset + p.numel for p in params), default=0)
        s = torch.ones(n, dtype=torch.float32)
        complete = True
        for sl in params:  # once per layout: a table, like the bucket's positions
            entry = self._by_name.get(sl.name)
            if entry is None:
                continue
            p, group = entry
            st = self.optimizer.state.get(p)
            if not st:  # no Adam step yet: no variance to precondition by (built again later)
                complete = False
                continue
            beta2 = float(group["betas"][1])
            k = st.get(FROZEN_KEY, int(st["step"]))
            v = st["max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"]
            d = (v.detach().float().reshape(-1).cpu() / (1 - beta2 ** k)).sqrt_().add_(group["eps"])
            s[sl.offset : sl.offset + sl.numel] = d.reciprocal_()
        s = s.to(device)
        if complete:
            self._scales[key] = s
        return s

    def _post(self, optimizer=None, args=None, kwargs=None) -> None:
        for p, g in self._hidden:
            p.grad = g
        self._hidden = []
