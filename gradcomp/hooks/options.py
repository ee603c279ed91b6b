"""A method and its options as the user gives them: a name or spec string
(``"powersgd:rank=2"``) and keyword options, checked against the method's config schema
(gradcomp/config.py) the same way for every entry point (``register``, ``gradcomp.State``,
the integrations, the benchmark's CLI)."""
from ..compressors import METHODS
from ..config import MethodConfig

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
                        f"'powersgd:rank=4', got {spec!r}: allowed {allowed}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if name not in METHODS and not (auto and name == AUTO):
        raise ValueError(f"unknown method {name!r}: allowed {allowed}")
    cfg = MethodConfig if name == AUTO else METHODS[name].config
    opts = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"bad option {item!r} in {spec!r}: expected key=value")
        key = key.strip()
        if key not in cfg.options():
            raise ValueError(f"unknown option {key!r} for {name}: allowed {', '.join(cfg.options())}")
        if key in opts:
            raise ValueError(f"option {key!r} given twice in {spec!r}: give each option once")
        opts[key] = cfg.parse_value(key, value.strip())
    return name, opts


def merge_options(method: str, options: dict, auto: bool = False) -> tuple[str, dict]:
    """(name, the spec's options + ``options``); an option given in both is an error."""
    name, opts = parse_spec(method, auto)
    clash = sorted(set(opts) & set(options))
    if clash:
        raise ValueError(f"option(s) {', '.join(clash)} given both in {method!r} and as arguments")
    return name, {**opts, **options}


def for_optimizer(method: str, options: dict, optimizer):
    """(name, config) as ``register`` builds them: the spec's options and the keywords, the
    method's measured defaults for Adam/AdamW (``Compressor.adam_defaults``) where the user
    gave none, then what the method takes from the optimizer (hooks/optimizer.py's
    ``momentum_options``: DGC's momentum)."""
    from .optimizer import is_adam, momentum_options
    name, opts = merge_options(method, options)
    comp = METHODS[name].compressor
    if is_adam(optimizer) and opts.get("adam", "auto") != "off":
        opts = {**comp.adam_defaults, **opts}
    if comp.reads_momentum:
        opts = momentum_options(opts, optimizer)
    return name, METHODS[name].config.from_dict(opts)


def build_config(method: str, **options):
    """The validated config of ``method`` (a name or spec string) with ``options``."""
    name, opts = merge_options(method, options)
    return name, METHODS[name].config.from_dict(opts)


def methods() -> list[dict]:
    """Every method with its description and options {name: (type, default)}."""
    return [{"name": s.name, "description": s.description, "options": s.config.options()}
            for s in METHODS.values()]
