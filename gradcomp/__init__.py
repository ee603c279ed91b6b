"""gradcomp: gradient-compression communication hooks for DistributedDataParallel.

    state = gradcomp.register(ddp_model, "dgc", ratio=0.001, optimizer=opt)
"""
from .compressors import METHODS
from .hooks import State, build_config, hook, methods, parse_spec, register

__version__ = "0.1.0"
__all__ = ["METHODS", "State", "build_config", "hook", "methods", "parse_spec",
           "register"]

_INTEGRATIONS = {"lightning", "accelerate", "hf", "integrations"}


def __getattr__(name):
    """``gradcomp.lightning``, ``gradcomp.accelerate``, ``gradcomp.hf``: the integrations
    (gradcomp/integrations/), imported on first use, so ``import gradcomp`` needs torch and
    numpy alone."""
    if name in _INTEGRATIONS:
        import importlib
        mod = importlib.import_module(".integrations" if name == "integrations"
                                      else f".integrations.{name}", __name__)
        globals()[name] = mod
        return mod
    raise AttributeError(f"module 'gradcomp' has no attribute {name!r}")
