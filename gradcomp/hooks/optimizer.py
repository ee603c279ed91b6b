"""What gradcomp does to a user's optimizer, in one place: :func:`bind` (called by the DDP
and FSDP adapters once every rank agreed), the step hooks every binding registers through
(:func:`step_hooks`: one pair per binding, run after a ``step(closure)``'s backward where
it matters, :func:`after_closure`), DGC's momentum read from SGD's param groups
(:class:`SGDMomentum`) and the checks of DGC's options against it (:func:`momentum_options`),
local steps' rounds (their step hooks, installed by :func:`bind`), what every rank's
optimizer must agree on (:func:`settings`) and the Adam binding below. No other module of
the library reads an optimizer's groups or hooks its steps (tests/test_design.py).

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
m, not filtered through another ten steps of it. Measured on the GPT (600-step probes, seed
0, allreduce 2.0034): onebit 2.0716 -> 2.0411, topk 2.0794 -> 2.0513; PowerSGD and TernGrad
measured worse with it (2.0550 -> 2.0915, 1.9796 -> 2.0146), so their "auto" stays
"freeze" (``Compressor.adam_exchange``). Under FSDP/HSDP (a rank holds only its shard of m)
and with ``delay`` "auto" is "freeze".

``adam="precondition"``
also compresses in the update's own scale, g / sqrt(v_hat) (:meth:`FrozenVariance.scale`), so
that the compression error is spread as Adam will apply it; measured on the GPT it was
0.007-0.014 nats worse than "freeze" for onebit, topk and powersgd (PowerSGD's low rank does
not survive the per-element scaling), so it is not the default. ``adam="off"`` leaves Adam to
see compressed gradients (the measured loss, kept for comparison).

Gradient clipping (``torch.nn.utils.clip_grad_norm_`` between backward and ``step()``, as
language-model loops do). In a compressed step the gradients the user's clip sees are what
the exchange handed back, whose norm carries the compression error: where the first moment
is exchanged, (average - b) / a holds the moment's error times 1 / (1 - beta1). Measured on
the GPT of bench/RESULTS.md (bench/clip_norms.py; AdamW, clip 1.0, seed 0): at the switch
the norm the clip sees went from 0.9 to 1.3-1.6 for onebit, against 0.8-1.2 for the exact
average of the same gradients; the ranks' own gradients' norm (RMS over ranks) was 13-26%
above the exact one and sqrt(<exact average, handed back>) about 20% below it, so neither
side of the exchange holds the norm a faithful clip needs. Over 600 steps onebit ended
+1.6% from allreduce clipped on every step, -2.1% clipped on the first 150 only (allreduce
itself: 2.0034 and 2.0015). So under DDP without ``delay`` the clip is taken off the
compressed steps (hooks/unclip.py: each compressed bucket's exchange records the norm of
what it handed back, the step's pre-hook undoes the coefficient the clip applied). The
dense warm-up's steps, whose gradients are the exact averages, keep the clip. Not under
FSDP/HSDP (a rank's gradients are its shard) nor with ``delay``.

What freezing costs by itself: ``topk:ratio=1`` (every element sent, v frozen at the
switch) ended the 2000-step GPT run at 1.6082 against allreduce's 1.6083 (bench/RESULTS.md).
"""
from __future__ import annotations

import torch

from ..compressors import METHODS
from ..config import Adam
from ..compressors.dgc import MOMENTUM_KEYS, MOMENTUM_OFF
from .local_steps import check_same_start
from .unclip import Unclip, local as _local

ADAM_TYPES = (torch.optim.Adam, torch.optim.AdamW)
# the optimizer hyperparameters every rank must agree on (registration's fingerprint)
_OPT_KEYS = ("lr", "momentum", "dampening", "nesterov", "betas", "eps", "weight_decay",
             "amsgrad", "maximize", "decoupled_weight_decay")
# Each method's measured gap with AdamW is its ``Compressor.measured["adamw_gap_pct"]``
# (bench/RESULTS.md, "Accuracy with AdamW": the GPT, 2000 steps, mean of the seeds there; validation loss
# above allreduce's, in percent, per method at its defaults and per exchange: DDP runs
# "momentum" or the method's own, FSDP/HSDP and delay "freeze"). register() warns once when
# a method runs at defaults whose gap in the exchange it runs is above HOLDS_PCT, naming the
# methods that held in that same exchange: the gap and the list come from one row each.
ADAM_GAP_KEY = "adamw_gap_pct"
LOCAL = "local"  # the row of a local-steps method: inner AdamW steps, the pseudo-gradient sent
HOLDS_PCT = 1.0
# options that do not change what a method computes (a run with only these is "at defaults")
_NEUTRAL = {"seed", "topology", "local_size", "min_numel", "exact", "adam", "delay",
            "dense_wire"}
_warned: set = set()
# per parameter, in the state's memory (so in gradcomp's checkpoint, by parameter name): the
# Adam step v froze at, and where v was still 0 then (learned on, as Adam's own)
FROZEN_SLOT, GAPS_SLOT = "adam_frozen_step", "adam_v_gaps"
# where earlier versions kept the frozen step: in optimizer.state[p] (read once,
# then removed: torch.distributed.checkpoint's get/set_state_dict drop or refuse such keys)
FROZEN_KEY = "gradcomp_frozen_step"


def adam_gap(method: str, mode: str) -> float | None:
    """``method``'s measured gap with AdamW at its defaults exchanging ``mode`` ("freeze",
    "momentum"), in percent above allreduce's validation loss; None: not measured."""
    return METHODS[method].compressor.measured.get(ADAM_GAP_KEY, {}).get(mode)


def default_exchange(method: str) -> str:
    """What ``method`` exchanges at its defaults with Adam/AdamW under DDP: "local" (the
    pseudo-gradient of its own local steps: a method whose ``local_steps`` defaults above
    1), else ``Compressor.adam_exchange``."""
    spec = METHODS[method]
    return LOCAL if spec.config().local_steps > 1 else spec.compressor.adam_exchange


def held(mode: str | None = None) -> list[str]:
    """The methods whose defaults held with AdamW (within HOLDS_PCT) where measured, the
    smallest gap first: each exchanging ``mode``, or (None) what it exchanges at its
    defaults under DDP (:func:`default_exchange`)."""
    gaps = [(adam_gap(m, mode or default_exchange(m)), m) for m in METHODS]
    return [m for gap, m in sorted(g for g in gaps if g[0] is not None) if gap <= HOLDS_PCT]


def warn_measured(state, optimizer, stacklevel: int = 3) -> None:
    """Once per method and process: a method whose measured defaults did not hold with
    Adam/AdamW, run at those defaults with Adam/AdamW (``stacklevel``: the user's call)."""
    method, config = state.method, state.config
    local = config.local_steps > 1  # Adam's own inner steps, the pseudo-gradient sent
    mode = LOCAL if local else adam_mode(state)
    own = METHODS[method].compressor.adam_defaults.get("adam")  # (off: the method's choice)
    if method in _warned or not is_adam(optimizer) or (config.adam == Adam.OFF and own != "off"):
        return
    gap = adam_gap(method, mode)
    if gap is None or gap <= HOLDS_PCT:
        return
    defaults = {**type(config)().to_dict(), **METHODS[method].compressor.adam_defaults}
    if any(v != defaults[k] for k, v in config.to_dict().items() if k not in _NEUTRAL):
        return  # the user chose other settings: not what was measured
    _warned.add(method)
    ok = held(mode)
    how = "with local steps" if local else f"with adam={str(mode)!r}"
    alternatives = (f"held within {HOLDS_PCT:g}% there {how}: "
                    f"{', '.join(repr(m) for m in ok)}, e.g. gradcomp.register(model, "
                    f"{ok[0]!r}, optimizer=opt)" if ok else
                    f"nothing held within {HOLDS_PCT:g}% there {how}")
    import warnings
    warnings.warn(
        f"gradcomp: {method} at its defaults with {type(unwrap(optimizer)).__name__} "
        f"({how[5:]}) ended {gap:.2f}% above allreduce's validation loss on our GPT "
        f"workload (2000 steps); {alternatives}. The measurements: docs/adam.md and "
        f"docs/methods.md.", UserWarning, stacklevel=stacklevel)


def check_method(name, config, optimizer) -> None:
    """At registration, before anything is attached: what the method's ``adam`` setting
    needs from the optimizer (the frozen-variance step below)."""
    if METHODS[name].compressor.stateless or config.adam == Adam.OFF:
        return
    adam = optimizer is not None and is_adam(optimizer)
    if config.adam != Adam.AUTO and not adam:
        raise ValueError(f"adam={str(config.adam)!r} needs optimizer=torch.optim.Adam or AdamW, got "
                         f"{type(optimizer).__name__}: allowed adam='auto' or 'off' here")
    if not adam:
        return
    if config.local_steps > 1:  # the inner steps are Adam's own (config checks the mode)
        return
    check_adam(optimizer)
    if config.dense_steps == 0 or (config.dense_steps is None and config.warmup_rule == "none"):
        raise ValueError(f"{name} with {type(unwrap(optimizer)).__name__}: "
                         f"Adam's second moment is learned during dense warm-up steps and "
                         f"frozen once compression starts (adam='freeze'), and this job has "
                         f"none (dense_steps=0 or warmup='none'); allowed: the adaptive "
                         f"warm-up (the default), dense_steps=N > 0, or adam='off' (Adam then "
                         f"sees compressed gradients: measured to lose accuracy)")


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


def settings(optimizer) -> dict:
    """What every rank's optimizer must agree on: its class and its groups' hyperparameters
    (hooks/agree.py compares them across ranks at registration)."""
    opt = unwrap(optimizer)
    out = {"optimizer": type(opt).__name__}
    for i, g in enumerate(getattr(opt, "param_groups", ())):
        out[f"optimizer group {i}"] = {k: _plain(g[k]) for k in _OPT_KEYS if k in g}
    return out


def _plain(v):
    if isinstance(v, torch.Tensor):  # a tensor lr/beta: its value
        return v.detach().cpu().tolist()
    return list(v) if isinstance(v, tuple) else v


def has_weight_decay(optimizer) -> bool:
    """Whether a group of ``optimizer`` decays its weights."""
    groups = getattr(unwrap(optimizer), "param_groups", ()) or ()
    return any(g.get("weight_decay") for g in groups)


def momentum_options(options: dict, optimizer, name: str) -> dict:
    """At registration, for a method that applies SGD's momentum itself (``reads_momentum``:
    DGC's momentum correction): check ``optimizer`` and return the options to build the
    config from (the momentum, nesterov and weight decay the optimizer holds are read from it
    at every step, never copied into the config)."""
    if optimizer is None:
        raise TypeError(f"{name} applies momentum inside the hook (momentum correction): pass "
                        "optimizer=your_SGD so gradcomp reads its momentum at every step and "
                        "it is never applied twice")
    optimizer = unwrap(optimizer)
    groups = optimizer.param_groups
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        # Adam's first moment is its momentum and it applies its own weight decay: dgc
        # runs as top-k with its accumulation, Adam's variance frozen (adam='freeze')
        given = {k: options[k] for k in MOMENTUM_KEYS if options.get(k, MOMENTUM_OFF[k])}
        if given:
            raise TypeError(f"{name}'s momentum correction needs torch.optim.SGD, got "
                            f"{type(optimizer).__name__} with {given}: Adam keeps its own "
                            f"momentum and weight decay; leave them out ({name} then runs as "
                            f"top-k with its accumulation), or use 'topk'")
        return options
    held = any(any(g.get(k, MOMENTUM_OFF[k]) for k in MOMENTUM_KEYS) for g in groups)
    if not isinstance(optimizer, torch.optim.SGD):
        if held or any(options.get(k, MOMENTUM_OFF[k]) for k in MOMENTUM_KEYS):
            raise TypeError(f"{name}'s momentum correction needs torch.optim.SGD, got "
                            f"{type(optimizer).__name__}; use 'topk' for other optimizers")
        return options
    for i, g in enumerate(groups):
        if g.get("maximize"):
            raise ValueError(f"{name} with maximize=True (param group {i}): not supported; "
                             f"minimize the negated loss")
        if g.get("dampening", 0):
            raise ValueError(f"{name} with dampening={g['dampening']!r} (param group {i}): "
                             f"allowed 0")
    if held:
        for k in MOMENTUM_KEYS:
            if k in options and any(g.get(k, MOMENTUM_OFF[k]) != options[k] for g in groups):
                raise ValueError(f"{k}={options[k]!r} given to {name} while the optimizer has "
                                 f"{k}={groups[0].get(k)!r}: it would be applied twice; "
                                 f"leave it out, {name} reads it from the optimizer")
        options = {k: v for k, v in options.items() if k not in MOMENTUM_KEYS}
    return options


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


def bind(state, optimizer, *, module=None, bucket_bytes=None, pieces=None, warn: bool = False,
         stacklevel: int = 4, outer_optimizer=None) -> None:
    """Attach to the user's optimizer all that the state's settings need, once every rank
    agreed (the adapters call this last): with ``local_steps`` the rounds' step hooks
    (hooks/local_steps.py); else the SGD momentum a method applies itself (DGC), the Adam binding
    (:class:`FrozenVariance`) and, with ``warn``, the measured-accuracy warning. ``pieces``:
    what the rounds average under HSDP: (name, tensor) pairs of this rank's rows;
    ``outer_optimizer``: the rounds' outer step (hooks/local_steps.py)."""
    if optimizer is None:
        return
    if state.rounds.active:  # inner steps are the optimizer's own; the rounds end in its hooks
        if pieces is None:  # every trainable parameter of ``module`` in module order
            names = state.param_names
            pieces = [(names[id(p)], p) for p in module.parameters() if id(p) in names]
        state.rounds.bind(pieces, module.named_buffers(), bucket_bytes, state.send_outer,
                          outer_optimizer)
        _check_first_round(state, optimizer)  # (a pre-hook that runs before the rounds')
        # the steps that run (not a wrapper's skips)
        state.rounds.hook(step_hooks(optimizer, "local", state.rounds.inner_pre,
                                     state.rounds.inner_post))
        state.bind_adam(optimizer)  # with sync_steps: the second moment they learned
        return
    inner = unwrap(optimizer)
    if state.compressor.reads_momentum and isinstance(inner, torch.optim.SGD):
        state.compressor.attach_momentum(
            SGDMomentum(inner, state.param_names, state.compressor.config.fixed(),
                        state.method))
    state.bind_adam(optimizer)
    if warn:
        warn_measured(state, optimizer, stacklevel=stacklevel)


def refuse_unseen_adam(state) -> None:
    """``register()`` without ``optimizer=``: gradcomp cannot see the optimizer, and with
    Adam/AdamW it must bind it (the second moment frozen once compression starts, the
    method's Adam defaults), or the compressed gradients reach Adam's second moment
    (``adam="off"``: measured to lose accuracy, docs/adam.md). So the first
    ``step()`` of an optimizer holding the model's parameters is looked at, once, through
    torch's global step pre-hook: Adam/AdamW raises there (on every rank: each takes the
    same step) naming the fix; any other optimizer goes on (the hook a no-op until
    close()). Binding it then would be too late: the method's Adam defaults shape the
    config, and every rank's optimizer is compared at registration."""
    if state.compressor.stateless or state.config.adam == Adam.OFF:
        return
    import weakref

    from torch.optim.optimizer import register_optimizer_step_pre_hook
    ref, done = weakref.ref(state), []  # (the hook stays, a no-op, until close(): torch
    # iterates the hooks' dict while it runs them)

    def pre(opt, args, kwargs):
        st = ref()
        if st is None or done:
            return
        names = st.param_names
        if not any(id(p) in names for g in opt.param_groups for p in g["params"]):
            return  # another model's optimizer
        done.append(True)
        if is_adam(opt):
            name = type(unwrap(opt)).__name__
            raise ValueError(
                f"gradcomp: {st.method!r} was registered without optimizer=, and {name} "
                f"steps the model's parameters: with Adam/AdamW gradcomp binds the optimizer "
                f"(Adam's second moment frozen once compression starts, the method's Adam "
                f"defaults; docs/adam.md), else the compressed gradients reach Adam's second "
                f"moment and lose accuracy. Register with gradcomp.register(model, "
                f"{st.method!r}, optimizer=opt), or with adam='off' to run without the "
                f"binding")
    state.on_close(register_optimizer_step_pre_hook(pre).remove)


def _check_first_round(state, optimizer) -> None:
    """Local steps: at the first step, before the rounds take their global point from this
    rank's model, every rank's model must be the same unless a checkpoint set the point
    (hooks/local_steps.py's ``check_same_start``); the hook goes after that step."""
    done = []  # (the hook stays, a no-op, until close(): torch iterates its hooks' dict)

    def pre(opt, args, kwargs):
        if not done:
            done.append(True)
            check_same_start(state)
    state.on_close(unwrap(optimizer).register_step_pre_hook(pre).remove)


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
        from ..memory import ParamMemory
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


class SGDMomentum:
    """Reads each parameter's momentum, Nesterov flag and weight decay from the SGD
    optimizer's param groups when a bucket is submitted, and keeps the optimizer from
    applying them itself: zero during ``step()`` (pre-hook), the user's values back after it
    (post-hook). With ``fixed`` options the groups must hold none: checked at every step."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[int, str], fixed: bool,
                 method: str):
        self.optimizer, self.fixed, self.method = optimizer, fixed, method
        # a parameter the optimizer does not hold is never updated: nothing to apply (-1)
        self._group_of = {n: -1 for n in names.values()}
        self._group_of.update({names[id(p)]: i for i, g in enumerate(optimizer.param_groups)
                               for p in g["params"] if id(p) in names})
        self._saved: list[dict] | None = None  # the user's values while step() runs
        self._layouts: dict[tuple, list[int]] = {}
        self.handles = step_hooks(optimizer, "momentum", self._pre, self._post)

    def close(self) -> None:
        self._restore()
        for h in self.handles:
            h.remove()

    def _groups(self) -> list[tuple]:
        """The user's values per group (+ a last entry, nothing, for parameters the optimizer
        does not hold). Inside step() (a closure's backward) and after a step() that raised
        (its post-hook never ran) the groups are zeroed: the user's values are the saved ones."""
        if self._saved is not None:
            return [tuple(s[k] for k in MOMENTUM_KEYS) for s in self._saved] + [(0.0, False, 0.0)]
        return [tuple(g.get(k, MOMENTUM_OFF[k]) for k in MOMENTUM_KEYS)
                for g in self.optimizer.param_groups] + [(0.0, False, 0.0)]

    def values(self, names) -> tuple | None:
        """(momentum, nesterov, weight_decay) for the parameters ``names`` at this step: one
        triple when they agree, else a triple of per-parameter lists; None with fixed options."""
        if self.fixed:
            return None
        groups = self._groups()
        idx = self._layouts.get(tuple(names))
        if idx is None:
            idx = self._layouts[tuple(names)] = [self._group_of[n] for n in names]
        first = groups[idx[0]]
        if all(groups[i] == first for i in idx):
            return first
        return tuple(list(col) for col in zip(*(groups[i] for i in idx)))

    def _pre(self, optimizer, args, kwargs) -> None:
        self._restore()  # a step() that raised never ran its post-hook
        groups = self._groups()[:-1]
        if self.fixed:
            bad = [(i, dict(zip(MOMENTUM_KEYS, v))) for i, v in enumerate(groups) if any(v)]
            if bad:
                raise ValueError(f"{self.method} applies the momentum/weight decay given in its options, "
                                 f"but param group {bad[0][0]} now holds {bad[0][1]} (a scheduler "
                                 f"cycling momentum, or your code): it would be applied twice. "
                                 f"Leave the options out so {self.method} reads them from the optimizer")
            return
        self._saved = [{k: g.get(k, MOMENTUM_OFF[k]) for k in MOMENTUM_KEYS} for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g.update(MOMENTUM_OFF)

    def _post(self, optimizer, args, kwargs) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._saved is not None:
            for g, s in zip(self.optimizer.param_groups, self._saved):
                g.update(s)
            self._saved = None


def loss_scale(scaler):
    """The loss scale the current gradients carry (a copy: the scaler updates it in place
    after the step), or None without an enabled GradScaler."""
    if scaler is None or not scaler.is_enabled() or getattr(scaler, "_scale", None) is None:
        return None
    return scaler._scale.detach().clone()


def frozen_variance(state, optimizer):
    """With Adam/AdamW and ``adam`` "auto"/"freeze"/"momentum"/"precondition": the binding that
    freezes Adam's second moment for the compressed parameters once compression starts
    (:class:`FrozenVariance`; with local steps, for every parameter after ``sync_steps``, the
    clip taken off the inner steps); None where there is none to make."""
    if state.config.adam == Adam.OFF or not is_adam(optimizer):
        return None
    names, comp, warmup = state.param_names, state.compressor, state.warmup
    if state.rounds.active:  # local steps: frozen after sync_steps for every inner step,
        if not state.config.sync_steps:  # whatever the method sends each round
            return None
        return FrozenVariance(optimizer, lambda p: id(p) in names,
                              lambda: not state.rounds.syncing, names, store=state.memory,
                              unclip=not state.sharded and not state.config.keep_clip)
    if comp.stateless:
        return None
    mode = adam_mode(state)
    return FrozenVariance(
        optimizer, lambda p: id(p) in names and comp.compresses(names[id(p)], tuple(p.shape)),
        lambda: not warmup.dense(max(state.step - 1, 0)), names,
        precondition=mode == Adam.PRECONDITION, momentum=mode == Adam.MOMENTUM,
        store=state.memory, unclip=not (state.sharded or state.config.delay
                                        or state.config.keep_clip))


def adam_mode(state) -> "Adam":
    """What ``adam`` runs with Adam/AdamW. "auto": the method's measured choice
    (``Compressor.adam_exchange``: "momentum", the first moment exchanged, for onebit,
    topk, threshold, dgc; "freeze" for powersgd, terngrad) under DDP without ``delay``
    and with error feedback on, else "freeze" (FSDP/HSDP: a rank holds only its shard
    of the moment; ``delay``: the moment read at the exchange is not the one the late
    average is applied to)."""
    c = state.config
    if c.adam != Adam.AUTO:
        return Adam(c.adam)
    if c.local_steps > 1:  # the inner steps are Adam's own (sync_steps: v frozen after them)
        return Adam.FREEZE
    ok = c.error_feedback and not c.delay and not state.sharded
    return Adam(state.compressor.adam_exchange) if ok else Adam.FREEZE


def dense_wire(state) -> str:
    """What the warm-up's dense steps put on the wire (``dense_wire``; "auto": bfloat16
    with Adam/AdamW bound, else float32)."""
    w = state.config.dense_wire
    if w == "auto":
        return "bfloat16" if state.adam is not None else "float32"
    return w
