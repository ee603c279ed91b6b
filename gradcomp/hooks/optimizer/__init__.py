"""What gradcomp does to a user's optimizer, in one place (the hook state's
``bind_optimizer``, called by the DDP and FSDP adapters once every rank agreed, puts these
together): the step hooks every binding registers through
(:func:`step_hooks`: one pair per binding, run after a ``step(closure)``'s backward where
it matters, :func:`after_closure`), DGC's momentum read from SGD's param groups
(:class:`SGDMomentum`) and the checks of DGC's options against it (:func:`momentum_options`),
local steps' first-round check (:func:`check_first_round`), what every rank's
optimizer must agree on (:func:`settings`) and the Adam binding. No module outside
this package reads an optimizer's groups or hooks its steps (tests/test_design.py).

The Adam binding (the frozen second moment, :class:`FrozenVariance`) is
hooks/optimizer/adam.py; the step hooks' primitives hooks/optimizer/steps.py.
"""
from __future__ import annotations

import torch

from ...compressors import METHODS
from ...config import Adam
from ...compressors.dgc import MOMENTUM_KEYS, MOMENTUM_OFF
from .adam import (FROZEN_KEY, FROZEN_SLOT, GAPS_SLOT, FrozenVariance, adam_mode,  # noqa: F401
                   check_adam, frozen_variance)
from .steps import ADAM_TYPES, after_closure, is_adam, step_hooks, unwrap  # noqa: F401

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


def adam_gap(method: str, mode: str) -> float | None:
    """``method``'s measured gap with AdamW at its defaults exchanging ``mode`` ("freeze",
    "momentum"), in percent above allreduce's validation loss; None: not measured."""
    return METHODS[method].compressor.measured.get(ADAM_GAP_KEY, {}).get(mode)


def default_exchange(method: str) -> str:
    """What ``method`` exchanges at its defaults with Adam/AdamW under DDP: "local" (the
    pseudo-gradient of its own local steps: a method whose ``local_steps`` defaults above
    1), else ``Compressor.adam_exchange``."""
    spec = METHODS[method]
    return LOCAL if spec.config().in_rounds else spec.compressor.adam_exchange


def held(mode: str | None = None) -> list[str]:
    """The methods whose defaults held with AdamW (within HOLDS_PCT) where measured, the
    smallest gap first: each exchanging ``mode``, or (None) what it exchanges at its
    defaults under DDP (:func:`default_exchange`)."""
    gaps = [(adam_gap(m, mode or default_exchange(m)), m) for m in METHODS]
    return [m for gap, m in sorted(g for g in gaps if g[0] is not None) if gap <= HOLDS_PCT]


def warn_measured(method: str, config, adam: Adam, optimizer, stacklevel: int = 3) -> None:
    """Once per method and process: a method whose measured defaults did not hold with
    Adam/AdamW, run at those defaults with Adam/AdamW (``adam``: the Adam mode it runs;
    ``stacklevel``: the user's call)."""
    local = config.in_rounds  # Adam's own inner steps, the pseudo-gradient sent
    mode = LOCAL if local else adam
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
    needs from the optimizer (the frozen-variance step of adam.py)."""
    if METHODS[name].compressor.stateless or config.adam == Adam.OFF:
        return
    adam = optimizer is not None and is_adam(optimizer)
    if config.adam != Adam.AUTO and not adam:
        raise ValueError(f"adam={str(config.adam)!r} needs optimizer=torch.optim.Adam or AdamW, got "
                         f"{type(optimizer).__name__}: allowed adam='auto' or 'off' here")
    if not adam:
        return
    if config.in_rounds:  # the inner steps are Adam's own (config checks the mode);
        if config.synchronous_start:  # after the synchronous steps, the frozen-variance step
            check_adam(optimizer)
        return
    check_adam(optimizer)
    if config.dense_steps == 0 or (config.dense_steps is None and config.warmup_rule == "none"):
        raise ValueError(f"{name} with {type(unwrap(optimizer)).__name__}: "
                         f"Adam's second moment is learned during dense warm-up steps and "
                         f"frozen once compression starts (adam='freeze'), and this job has "
                         f"none (dense_steps=0 or warmup='none'); allowed: the adaptive "
                         f"warm-up (the default), dense_steps=N > 0, or adam='off' (Adam then "
                         f"sees compressed gradients: measured to lose accuracy)")


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


def bind_momentum(compressor, optimizer, names: dict, method: str) -> None:
    """A method that applies SGD's momentum itself (DGC's momentum correction) reads it from
    ``optimizer``'s param groups at every step (:class:`SGDMomentum`); else nothing."""
    inner = unwrap(optimizer)
    if compressor.reads_momentum and isinstance(inner, torch.optim.SGD):
        compressor.attach_momentum(SGDMomentum(inner, names, compressor.config.fixed(), method))


def refuse_unseen_adam(method: str, compressor, config, names):
    """``register()`` without ``optimizer=``: gradcomp cannot see the optimizer, and with
    Adam/AdamW it must bind it (the second moment frozen once compression starts, the
    method's Adam defaults), or the compressed gradients reach Adam's second moment
    (``adam="off"``: measured to lose accuracy, docs/adam.md). So the first
    ``step()`` of an optimizer holding the model's parameters (``names()``: id -> name, None
    once the state is gone) is looked at, once, through torch's global step pre-hook: Adam/AdamW raises there (on every
    rank: each takes the same step) naming the fix; any other optimizer goes on. Binding it
    then would be too late: the method's Adam defaults shape the config, and every rank's
    optimizer is compared at registration. Returns the hook's ``remove`` (the hook stays, a
    no-op, until then: torch iterates the hooks' dict while it runs them), or None."""
    if compressor.stateless or config.adam == Adam.OFF:
        return None
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    done = []

    def pre(opt, args, kwargs):
        mine = names()
        if done or not mine or not any(id(p) in mine for g in opt.param_groups
                                       for p in g["params"]):
            return  # looked at already, the state gone, or another model's optimizer
        done.append(True)
        if is_adam(opt):
            name = type(unwrap(opt)).__name__
            raise ValueError(
                f"gradcomp: {method!r} was registered without optimizer=, and {name} "
                f"steps the model's parameters: with Adam/AdamW gradcomp binds the optimizer "
                f"(Adam's second moment frozen once compression starts, the method's Adam "
                f"defaults; docs/adam.md), else the compressed gradients reach Adam's second "
                f"moment and lose accuracy. Register with gradcomp.register(model, "
                f"{method!r}, optimizer=opt), or with adam='off' to run without the "
                f"binding")
    return register_optimizer_step_pre_hook(pre).remove


def check_first_round(rounds, optimizer, group, numels: dict):
    """Local steps: at the first step, before the rounds take their global point from this
    rank's model, every rank's model must be the same unless a checkpoint set the point
    (hooks/local_steps.py's ``LocalSteps.check_same_start``, over ``group``). Returns the
    hook's ``remove`` (the hook stays, a no-op, until then: torch iterates its hooks' dict)."""
    done = []

    def pre(opt, args, kwargs):
        if not done:
            done.append(True)
            rounds.check_same_start(group, numels)
    return unwrap(optimizer).register_step_pre_hook(pre).remove


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


def dense_wire(config, adam_bound: bool) -> str:
    """What the warm-up's dense steps put on the wire (``dense_wire``; "auto": bfloat16
    with Adam/AdamW bound, else float32)."""
    w = config.dense_wire
    if w == "auto":
        return "bfloat16" if adam_bound else "float32"
    return w
