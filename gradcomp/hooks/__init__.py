"""Everything that runs a method inside a training job: the plug-in points (``ddp.py``: DDP's
comm hook, the one module touching GradBucket; ``fsdp.py``: FSDP2's reduce hooks, the one
touching FSDP's internals; ``register.py`` dispatches to them), the user's state (``public.py``:
what a user holds), the hook state behind it (``state.py``) and its components (warm-up
schedule, delay, local steps, guard, telemetry, topology: one module each), the engine that orders every collective (``engine.py``), the
checkpoint's format, checks and collective load (``checkpoint.py``) and what is done to the
user's optimizer (``optimizer/``). docs/design.md maps them."""
from .ddp import hook
from .options import build_config, methods, parse_spec
from .public import State
from .register import register

__all__ = ["State", "build_config", "hook", "methods", "parse_spec", "register"]
