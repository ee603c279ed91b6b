"""gradcomp: gradient-compression communication hooks for DistributedDataParallel.

    state = gradcomp.register(ddp_model, "dgc", ratio=0.001, optimizer=opt)
"""
from .compressors import METHODS
from .hooks import GradcompState, build_config, hook, methods, parse_spec, register

State = GradcompState
__version__ = "0.1.0"
__all__ = ["METHODS", "GradcompState", "State", "build_config", "hook", "methods", "parse_spec",
           "register"]
