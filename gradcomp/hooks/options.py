"""A method and its options as the user gives them: a name or spec string
(``"powersgd:rank=2"``) and keyword options, checked against the method's config schema
(gradcomp/config.py) the same way for every entry point (``register``, ``gradcomp.State``,
the integrations, the benchmark's CLI)."""
import difflib

from ..compressors import METHODS
from ..config import MAX_QUOTED, MethodConfig, clip, quote
from .optimizer import is_adam, momentum_options

AUTO = "auto"  # register(model, "auto"): the fastest method that holds (hooks/auto.py)
def is_auto(spec) -> bool:
    """Whether ``spec`` asks for method="auto" (with or without options)."""
    return isinstance(spec, str) and spec.strip().partition(":")[0] == AUTO


def parse_spec(spec: str, auto: bool = False) -> tuple[str, dict]:
    """``"name:key=value,key=value"`` -> (name, {key: value}) with values typed per option;
    a key given twice is refused. ``auto``: "auto" is a name too (its options: those every
    method shares)."""
    allowed = ", ".join(sorted(METHODS) + ([AUTO] if auto else []))
    if not isinstance(spec, str):
        raise TypeError(f"method must be a name or spec string such as 'onebit' or "
                        f"'powersgd:rank=4', got {quote(spec)}: allowed {allowed}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if name not in METHODS and not (auto and name == AUTO):
        near = _nearest(name, [*METHODS, *([AUTO] if auto else [])])
        raise ValueError(f"unknown method {quote(name)}{near}: allowed {allowed}")
    cfg = MethodConfig if name == AUTO else METHODS[name].config
    opts = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"bad option {quote(item)} in {quote(spec)}: expected key=value")
        key = key.strip()
        if key not in cfg.options():
            raise ValueError(f"unknown option {quote(key)} for {name}: allowed "
                             f"{', '.join(cfg.options())}{_nearest(key, cfg.options())}")
        if key in opts:
            raise ValueError(f"option {key!r} given twice in {quote(spec)}: give each option once")
        opts[key] = _bounded(cfg.parse_value, key, value.strip())
    return name, opts


def merge_options(method: str, options: dict, auto: bool = False) -> tuple[str, dict]:
    """(name, the spec's options + ``options``); an option given in both is an error."""
    name, opts = parse_spec(method, auto)
    check_keywords(name, options)
    clash = sorted(set(opts) & set(options))
    if clash:
        raise ValueError(f"option(s) {', '.join(clash)} given both in {quote(method)} and as "
                         f"arguments")
    return name, {**opts, **options}


def check_keywords(name: str, options: dict, own: tuple = (), call: str = "") -> None:
    """Refuse a keyword that is neither one of ``call``'s own (``own``) nor an option of method
    ``name``, naming it and the nearest valid one (a misspelled ``optimiser=`` would otherwise
    be read as a missing ``optimizer=``). ValueError, as for every option refused."""
    known = (MethodConfig if name == AUTO else METHODS[name].config).options()
    unknown = [k for k in options if k not in known]
    if not unknown:
        return
    near = _nearest(unknown[0], [*own, *known])
    if call:
        raise ValueError(f"{call} got an unknown keyword {quote(unknown[0])}{near} (allowed: "
                         f"{call}'s own: {', '.join(own)}; {name}'s options: {', '.join(known)})")
    raise ValueError(f"unknown option(s) {clip(', '.join(map(str, unknown)), 200)}: "
                     f"allowed {', '.join(sorted(known))}{near}")


def _bounded(fn, *args):
    """``fn(*args)``, its TypeError/ValueError (a config's check quotes the value it was
    given) cut to a bounded length."""
    try:
        return fn(*args)
    except (TypeError, ValueError) as exc:
        if len(str(exc)) <= 2 * MAX_QUOTED:
            raise
        raise type(exc)(clip(str(exc), 2 * MAX_QUOTED)) from None


def _nearest(key, allowed) -> str:
    """' (did you mean 'x'?)' for the nearest of ``allowed`` to ``key`` (difflib), or ''."""
    if not isinstance(key, str):
        return ""
    near = difflib.get_close_matches(key, list(allowed), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def for_optimizer(method: str, options: dict, optimizer):
    """(name, config) as ``register`` builds them: the spec's options and the keywords, the
    method's measured defaults for Adam/AdamW (``Compressor.adam_defaults``) where the user
    gave none, then what the method takes from the optimizer (hooks/optimizer/'s
    ``momentum_options``: DGC's momentum)."""
    name, opts = merge_options(method, options)
    comp = METHODS[name].compressor
    if is_adam(optimizer) and opts.get("adam", "auto") != "off":
        opts = {**comp.adam_defaults, **opts}
    if comp.reads_momentum:
        opts = momentum_options(opts, optimizer, name)
    return name, _bounded(METHODS[name].config.from_dict, opts)


def build_config(method: str, **options):
    """The validated config of ``method`` (a name or spec string) with ``options``."""
    name, opts = merge_options(method, options)
    return name, _bounded(METHODS[name].config.from_dict, opts)


def methods() -> list[dict]:
    """Every method with its description, its options {name: (type, default)} (the defaults
    with SGD, or any optimizer but Adam/AdamW) and ``adam_defaults``: {name: value} of the
    options that ``register(..., optimizer=opt)`` sets otherwise for Adam/AdamW where the
    user gave none (the method's measured Adam defaults, ``Compressor.adam_defaults``;
    ``dense_wire="auto"`` resolved: bfloat16 with Adam/AdamW where the method sets none)."""
    out = []
    for s in METHODS.values():
        adam = dict(s.compressor.adam_defaults)
        if not s.compressor.stateless and not s.config().in_rounds:
            adam.setdefault("dense_wire", "bfloat16")
        out.append({"name": s.name, "description": s.description,
                    "options": s.config.options(), "adam_defaults": adam})
    return out
