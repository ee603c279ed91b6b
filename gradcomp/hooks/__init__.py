"""DDP adapters: the only code that touches GradBucket and futures."""
from .ddp import build_config, hook, methods, parse_spec, register
from .state import GradcompState

__all__ = ["GradcompState", "build_config", "hook", "methods", "parse_spec", "register"]
