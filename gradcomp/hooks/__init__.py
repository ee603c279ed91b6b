"""The adapters (DDP's comm hook, FSDP2's reduce hooks) over the hook state: the only code
that touches GradBucket, futures and FSDP's internals."""
from .ddp import hook
from .options import build_config, methods, parse_spec
from .register import register
from .state import GradcompState

__all__ = ["GradcompState", "build_config", "hook", "methods", "parse_spec", "register"]
