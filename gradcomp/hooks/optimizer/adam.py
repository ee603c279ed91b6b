"""Adam and AdamW with compressed gradients (:class:`FrozenVariance`). Error feedback makes the
*sum* over steps of the compressed gradients equal the sum of the true ones, which is all a
linear update (SGD with momentum) needs. Adam is not linear in the gradient: its second
moment v averages the squares of what it receives, and the squares of compressed gradients
are not the squares of gradients. Top-k at 5% hands each coordinate a burst about 20 times
its gradient one step in 20 (v grows ~20x, the step shrinks ~4.5x); 1-bit hands every
coordinate of a 256-element chunk the chunk's mean magnitude (v loses the per-coordinate
scale Adam exists for). The measurements behind each choice below are in docs/adam.md
("The probes behind the design").

The cure of 1-bit Adam (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
with Adam's Convergence Speed", ICML 2021, arXiv:2102.02888): v settles early in training, so
learn it during a dense warm-up and freeze it once compression starts. With v fixed, Adam's
update is m / sqrt(v): linear in the gradients again, and error feedback works as it does for
momentum SGD. Here, per parameter the method compresses:

  1. During the warm-up (dense steps: the adaptive warm-up's, or ``dense_steps``) the
     optimizer runs untouched: v is learned from exact averaged gradients.
  2. At the parameter's first compressed step its Adam state is frozen: v stays as it is,
     with the bias correction of that step (``1 - beta2**k``, k its Adam step count then,
     kept in the state's memory, slot ``adam_frozen_step``: it travels with gradcomp's
     checkpoint, by parameter name, not in the optimizer's state, whose extra keys
     torch.distributed.checkpoint drops or refuses). Elements whose v is still 0 then (no
     gradient reached them during the warm-up: an embedding row of a token not yet seen, a
     dead unit) are not frozen: their v goes on learning as Adam's own (v = beta2 v +
     (1 - beta2) g^2; where they are: slot ``adam_v_gaps``), else their first step would be
     m / eps.
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

What goes through the method once v is frozen (``adam="momentum"``, what "auto" runs for the
error-feedback methods but PowerSGD: :meth:`FrozenVariance.momentum`): 1-bit Adam's own
exchange. Each rank compresses its next first moment, beta1 m + (1 - beta1) g_i (m the
optimizer's exp_avg, identical on every rank), with the method's error feedback, and the
average of the compressed moments becomes every rank's m. It is done without a second copy
of m: the exchange compresses a g + b (a = 1 - beta1, b = beta1 m, plus Adam's L2 term, the
sign of ``maximize``) and writes (average - b) / a into ``p.grad``, so that the frozen step's
own m = beta1 m + (1 - beta1) g lands on the average. The error feedback then works on the
momentum, as DGC's momentum correction does for SGD: what a rank held back is released into
m, not filtered through another ten steps of it. It helped onebit and topk and not PowerSGD
or TernGrad, whose "auto" stays "freeze" (``Compressor.adam_exchange``). Under FSDP/HSDP (a rank holds only its shard of m)
and with ``delay`` "auto" is "freeze".

``adam="precondition"``
also compresses in the update's own scale, g / sqrt(v_hat) (:meth:`FrozenVariance.scale`), so
that the compression error is spread as Adam will apply it; it measured worse than "freeze"
(PowerSGD's low rank does not survive the per-element scaling), so it is not the default. ``adam="off"`` leaves Adam to
see compressed gradients (the measured loss, kept for comparison).

Gradient clipping (``torch.nn.utils.clip_grad_norm_`` between backward and ``step()``, as
language-model loops do). In a compressed step the gradients the user's clip sees are what
the exchange handed back, whose norm carries the compression error: where the first moment
is exchanged, (average - b) / a holds the moment's error times 1 / (1 - beta1), and neither
side of the exchange holds the norm a faithful clip needs (measured: docs/adam.md). So
under DDP without ``delay`` the clip is taken off the
compressed steps (hooks/unclip.py: each compressed bucket's exchange records the norm of
what it handed back, the step's pre-hook undoes the coefficient the clip applied). The
dense warm-up's steps, whose gradients are the exact averages, keep the clip. Not under
FSDP/HSDP (a rank's gradients are its shard) nor with ``delay``.
"""
from __future__ import annotations

import torch

from ...config import Adam
from ...memory import ParamMemory
from ..unclip import Unclip, local as _local
from .steps import after_closure, is_adam, step_hooks, unwrap

# per parameter, in the state's memory (so in gradcomp's checkpoint, by parameter name): the
# Adam step v froze at, and where v was still 0 then (learned on, as Adam's own)
FROZEN_SLOT, GAPS_SLOT = "adam_frozen_step", "adam_v_gaps"
# where earlier versions kept the frozen step: in optimizer.state[p] (read once,
# then removed: torch.distributed.checkpoint's get/set_state_dict drop or refuse such keys)
FROZEN_KEY = "gradcomp_frozen_step"


def check_adam(optimizer) -> None:
    """Refuse the Adam settings the frozen-variance step does not reproduce."""
    for i, g in enumerate(unwrap(optimizer).param_groups):
        for key in ("capturable", "differentiable"):
            if g.get(key):
                raise ValueError(f"{key}=True in param group {i} of "
                                 f"{type(unwrap(optimizer)).__name__}: not supported with "
                                 f"compression (adam='freeze'); set {key}=False, or adam='off'")


def _decoupled(optimizer, group) -> bool:
    """Whether ``group`` decays its weights decoupled (AdamW's, or Adam's
    ``decoupled_weight_decay=True`` in that group) rather than as Adam's L2 term."""
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))


class FrozenVariance:
    """Adam/AdamW with v frozen at the switch to compression, for the parameters the method
    compresses (module docstring). ``compressed(p)``: whether the method compresses
    parameter p; ``compressing()``: whether the gradients of the step about to be taken
    went compressed."""

    def __init__(self, optimizer, compressed, compressing, names: dict[int, str] | None = None,
                 precondition: bool = False, momentum: bool = False, store=None,
                 unclip: bool = False):
        self.optimizer = unwrap(optimizer)
        # where the frozen steps and v's gaps are kept: the state's memory (checkpointed
        # with it), or one of its own (a binding made by hand: its store.state_dict())
        self.store = store if store is not None else ParamMemory()
        self.store.unguarded |= {FROZEN_SLOT, GAPS_SLOT}
        self._frozen: dict = {}  # the frozen steps as ints (a cache of the store's)
        self.momentum_mode = momentum
        self._compressing = compressing
        self._mine = {id(p) for g in self.optimizer.param_groups for p in g["params"]
                      if compressed(p)}
        self.precondition = precondition
        names = names or {}
        # name -> (parameter, its group's index) for the parameters this binding steps: the
        # group is looked up at each use, as optimizer.load_state_dict() replaces the groups'
        # dicts (a resumed job's beta1 schedule would otherwise be read from the old ones)
        self._by_name = {names[id(p)]: (p, i) for i, g in enumerate(self.optimizer.param_groups)
                         for p in g["params"] if id(p) in self._mine and id(p) in names}
        # each parameter's key in the store: its name, else its place in the optimizer
        self._key = {id(p): names.get(id(p), f"param {j}") for j, p in enumerate(
            p for g in self.optimizer.param_groups for p in g["params"])}
        self._scales: dict = {}  # bucket layout -> its preconditioner (constant once frozen)
        self._moments: dict = {}  # bucket layout -> where its first moments go (momentum)
        self._hidden: list = []
        # the clip taken off the compressed steps (module docstring, "Gradient clipping")
        self.unclip = Unclip({n: p for n, (p, _) in self._by_name.items()}, lambda: [
            p for g in self.optimizer.param_groups for p in g["params"]]) if unclip else None
        self.handles = step_hooks(self.optimizer, "adam", self._pre, self._post)

    def reset(self) -> None:
        """Forget the cached preconditioners and frozen steps: a loaded checkpoint
        (gradcomp's or the optimizer's) brings its own."""
        self._scales.clear()
        self._moments.clear()
        self._frozen.clear()

    def frozen_step(self, p, state=None, v=None) -> int | None:
        """The Adam step parameter p's v froze at, None before its switch. With its Adam
        ``state`` and v: at the switch, record it (the optimizer's step count now, or the
        one an older checkpoint kept in the optimizer's state) and where v is still 0."""
        key = self._key[id(p)]
        k = self._frozen.get(key)
        if k is None:
            t = self.store.find(FROZEN_SLOT, key)
            if t is not None:
                k = self._frozen[key] = int(t.item())
        if state is not None:
            legacy = state.pop(FROZEN_KEY, None)
            if k is None:
                k = self._frozen[key] = int(legacy if legacy is not None else state["step"])
                self.store.tensor(FROZEN_SLOT, key,
                                  lambda: torch.tensor([float(k)], dtype=torch.float64))
                gaps = None if legacy is not None else _local(v) == 0
                if gaps is not None and gaps.any():  # one host read per parameter, once
                    self.store.tensor(GAPS_SLOT, key, lambda: gaps.to(torch.bfloat16))
        return k

    def close(self) -> None:
        self._post()
        for h in self.handles:
            h.remove()

    def record(self, step: int, back: torch.Tensor, params, scale=None) -> None:
        """A compressed bucket of step ``step``: the norm of what the exchange handed back
        for each compressed parameter among ``params`` (slices), for the step's pre-hook
        (:class:`~gradcomp.hooks.unclip.Unclip`)."""
        if self.unclip is not None:
            self.unclip.record(step, back, params, scale)

    def _pre(self, optimizer=None, args=None, kwargs=None):
        self._post()  # a step() that raised never ran its post-hook
        return after_closure(args, kwargs, self._frozen_step)

    @torch.no_grad()
    def _frozen_step(self) -> None:
        if not self._compressing():
            return
        opt = self.optimizer
        # GradScaler.step() on a fused optimizer (``fused=True``) leaves the gradients scaled
        # and steps even after an overflow: it hands the optimizer its scale and overflow
        # flag as attributes for the fused kernel. Read here the same way (the flag's host
        # read, once per step, is the one GradScaler makes for every other optimizer)
        found_inf = getattr(opt, "found_inf", None)
        if found_inf is not None and bool(found_inf):
            return  # the fused step skips itself; so does this one
        grad_scale = getattr(opt, "grad_scale", None)
        if self.unclip is not None:
            self.unclip.apply(grad_scale)
        for group in opt.param_groups:
            params = [p for p in group["params"] if id(p) in self._mine and p.grad is not None
                      and opt.state.get(p)]  # no Adam state yet: the optimizer's own step
            if not params:
                continue
            self._step_group(group, params, _decoupled(opt, group), grad_scale)
            for p in params:
                self._hidden.append((p, p.grad))
                p.grad = None

    def _step_group(self, group, params, decoupled, grad_scale=None) -> None:
        opt = self.optimizer
        lr = float(group["lr"])
        beta1, beta2 = (float(b) for b in group["betas"])
        eps, wd = group["eps"], group["weight_decay"]
        grads = [p.grad for p in params]
        if grad_scale is not None:
            grads = torch._foreach_div(grads, grad_scale.to(grads[0].device))
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
        for p, s, v in zip(params, states, vs):  # host scalars per parameter, not tensor work
            frozen = self.frozen_step(p, s, v)
            s["step"] += 1
            t = int(s["step"])
            step_sizes.append(-lr / (1 - beta1 ** t))
            v_scales.append(1.0 / (1 - beta2 ** frozen) ** 0.5)
        # Where v was still 0 at the switch (an embedding row whose token the warm-up never
        # saw, a unit that was dead through it), a frozen v would make the step m / eps: v
        # goes on learning there as Adam's own, v += (1 - beta2) (g^2 - v). A loop over the
        # few parameters that have such elements (embeddings), not over all of them.
        for p, g, v in zip(params, grads, vs):
            key = self._key[id(p)]
            gaps = self.store.find(GAPS_SLOT, key)
            if gaps is not None:
                v, g = _local(v), _local(g)
                if gaps.device != v.device or gaps.dtype != v.dtype:  # once (after a load)
                    gaps = gaps.to(v.device, v.dtype)
                    self.store.put(GAPS_SLOT, key, gaps)
                if gaps.numel() != v.numel():
                    raise ValueError(f"gradcomp: the Adam gaps of parameter {key!r} hold "
                                     f"{gaps.numel()} elements, its v {v.numel()}: a "
                                     f"checkpoint of another model; resume with the model "
                                     f"it was saved with")
                gaps = gaps.view_as(v)
                v.addcmul_(gaps, g.to(v.dtype).square().sub_(v), value=1 - beta2)
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
            p, group = entry[0], self.optimizer.param_groups[entry[1]]
            st = self.optimizer.state.get(p)
            if not st:  # no Adam step yet: no variance to precondition by (built again later)
                complete = False
                continue
            beta2 = float(group["betas"][1])
            k = self.frozen_step(p)
            k = int(st.get(FROZEN_KEY, st["step"])) if k is None else k
            v = st["max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"]
            v = v.detach().float().reshape(-1).cpu()
            d = (v / (1 - beta2 ** k)).sqrt_().add_(group["eps"]).reciprocal_()
            # 1 where v is 0 (no variance yet: the frozen step learns it there), not 1 / eps
            s[sl.offset : sl.offset + sl.numel] = d.masked_fill_(v == 0, 1.0)
        s = s.to(device)
        if complete:
            self._scales[key] = s
        return s

    def momentum(self, params, device):
        """With ``momentum`` (1-bit Adam's exchange): (a, b), per element of the bucket, such
        that a g + b is this rank's next first moment, beta1 m + (1 - beta1) g (with the
        L2 weight decay Adam adds to g, and the sign of ``maximize``); (1, 0) where the
        parameter is not compressed or has no Adam state yet. The exchange compresses
        a g + b and hands back (average - b) / a, so that the frozen step's
        m = beta1 m + (1 - beta1) g_hat is the average of the compressed moments. None
        without ``momentum``. Read at the exchange, before the step that uses it: one cat
        per bucket (the coefficients are cached per layout)."""
        if not self.momentum_mode:
            return None
        # the groups' beta1, weight decay and maximize are part of the key: a scheduler may
        # move beta1 (OneCycleLR's cycle_momentum does, with Adam)
        hyper = tuple((g["betas"][0], g["weight_decay"], g.get("maximize", False))
                      for g in self.optimizer.param_groups)
        key = (tuple((p.name, p.offset, p.numel) for p in params), str(device), hyper)
        hit = self._moments.get(key)
        if hit is None and len(self._moments) > 64:  # a beta1 schedule: keep the cache small
            self._moments.clear()
        if hit is None:
            hit, complete = self._moment_layout(params, device)
            if complete:  # else a compressed parameter has no Adam state yet: built again
                self._moments[key] = hit
        pieces, a, beta1, l2 = hit
        if a is None:
            return None
        ms = [m if isinstance(m, torch.Tensor) else self.optimizer.state[m[0]]["exp_avg"]
              .detach().reshape(-1) for m in pieces]
        b = torch.cat([m.to(torch.float32) for m in ms]).mul_(beta1)
        if l2 is not None:  # the parameters' values, laid out as their moments
            ws = [w if isinstance(w, torch.Tensor) else w[0].detach().reshape(-1)
                  for w in pieces]
            b.addcmul_(torch.cat([w.to(torch.float32) for w in ws]), l2)
        return a, b

    def _moment_layout(self, params, device):
        """((pieces, a, beta1 per element, L2 coefficient per element or None), complete) for
        a bucket: a piece is (parameter,) where its exp_avg goes, a zero tensor elsewhere;
        ``complete``: every compressed parameter has its Adam state (cacheable)."""
        n = max((p.offset + p.numel for p in params), default=0)
        a = torch.ones(n, dtype=torch.float32)
        beta = torch.zeros(n, dtype=torch.float32)
        wdc = torch.zeros(n, dtype=torch.float32)
        pieces, at, any_l2, complete = [], 0, False, True
        for sl in sorted(params, key=lambda s: s.offset):
            entry = self._by_name.get(sl.name)
            st = None if entry is None else self.optimizer.state.get(entry[0])
            if entry is None or not st:
                complete = complete and entry is None
                continue
            p, group = entry[0], self.optimizer.param_groups[entry[1]]
            if sl.offset > at:
                pieces.append(torch.zeros(sl.offset - at, dtype=torch.float32, device=device))
            beta1 = float(group["betas"][0])
            sign = -1.0 if group.get("maximize") else 1.0
            span = slice(sl.offset, sl.offset + sl.numel)
            a[span], beta[span] = sign * (1 - beta1), beta1
            wd = float(group["weight_decay"])
            if wd and not _decoupled(self.optimizer, group):
                wdc[span], any_l2 = (1 - beta1) * wd, True
            pieces.append((p,))
            at = sl.offset + sl.numel
        if not pieces:
            return ([], None, None, None), complete
        if n > at:
            pieces.append(torch.zeros(n - at, dtype=torch.float32, device=device))
        return (pieces, a.to(device), beta.to(device),
                wdc.to(device) if any_l2 else None), complete

    def _post(self, optimizer=None, args=None, kwargs=None) -> None:
        for p, g in self._hidden:
            p.grad = g
        self._hidden = []


def frozen_variance(optimizer, *, config, names, compressor, memory, sharded, rounds,
                    compressing):
    """With Adam/AdamW and ``adam`` "auto"/"freeze"/"momentum"/"precondition": the binding that
    freezes Adam's second moment for the compressed parameters once compression starts
    (:class:`FrozenVariance`; with local steps, for every parameter after ``sync_steps``, the
    clip taken off the inner steps); None where there is none to make. ``names``: the
    parameters' names by id; ``memory``: where its slots live; ``sharded``: FSDP/HSDP;
    ``rounds``: the local-steps component; ``compressing()``: whether the step being taken
    is compressed."""
    if config.adam == Adam.OFF or not is_adam(optimizer):
        return None
    if config.in_rounds:  # local steps: frozen after sync_steps for every inner step,
        if not config.synchronous_start:  # whatever the method sends each round
            return None
        return FrozenVariance(optimizer, lambda p: id(p) in names,
                              lambda: not rounds.syncing, names, store=memory,
                              unclip=not sharded and not config.keep_clip)
    if compressor.stateless:
        return None
    mode = adam_mode(config, compressor, sharded)
    return FrozenVariance(
        optimizer, lambda p: id(p) in names and compressor.compresses(names[id(p)], tuple(p.shape)),
        compressing, names,
        precondition=mode == Adam.PRECONDITION, momentum=mode == Adam.MOMENTUM,
        store=memory, unclip=not (sharded or config.delay or config.keep_clip))


def adam_mode(config, compressor, sharded: bool) -> "Adam":
    """What ``adam`` runs with Adam/AdamW. "auto": the method's measured choice
    (``Compressor.adam_exchange``: "momentum", the first moment exchanged, for onebit,
    topk, threshold, dgc; "freeze" for powersgd, terngrad) under DDP without ``delay``
    and with error feedback on, else "freeze" (FSDP/HSDP: a rank holds only its shard
    of the moment; ``delay``: the moment read at the exchange is not the one the late
    average is applied to)."""
    c = config
    if c.adam != Adam.AUTO:
        return Adam(c.adam)
    if c.in_rounds:  # the inner steps are Adam's own (sync_steps: v frozen after them)
        return Adam.FREEZE
    ok = c.error_feedback and not c.delay and not sharded
    return Adam(compressor.adam_exchange) if ok else Adam.FREEZE
