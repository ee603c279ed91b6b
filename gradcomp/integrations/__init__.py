"""One line in the training frameworks users already run, each a small adapter over
:func:`gradcomp.register` and :meth:`State.all_ranks` (the state in the framework's own
checkpoints). Imported on demand: ``import gradcomp`` imports none of the frameworks.

* :mod:`gradcomp.integrations.lightning`: ``GradcompCallback`` for ``lightning.pytorch.Trainer``;
* :mod:`gradcomp.integrations.accelerate`: ``register(accelerator, model, method, ...)``;
* :mod:`gradcomp.integrations.hf`: ``register(trainer, method, ...)`` for the HF ``Trainer``.

docs/integrations.md shows each in a job.
"""
from __future__ import annotations

import warnings

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def distributed() -> bool:
    """Whether this process is one of several ranks (a framework on one device never wraps
    the model: there is nothing to compress)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check_model(model, where: str, framework: str) -> None:
    """The framework's wrapped model is what ``register`` takes (DDP or fully_shard), or a
    clear error naming the strategy to use."""
    from ..hooks import fsdp

    if isinstance(model, DistributedDataParallel) or fsdp.is_fsdp(model):
        return
    raise TypeError(f"gradcomp with {framework}: {where} is {type(model).__name__}, not "
                    f"DistributedDataParallel or a fully_shard (FSDP2) model; gradcomp "
                    f"compresses DDP's and FSDP2's gradient exchange: use the DDP strategy "
                    f"(or FSDP2), not DeepSpeed, FSDP1 or a single device")


# register()'s own keywords, beside the method's options
REGISTER_KEYWORDS = ("lanes", "scaler", "log_dir", "log_all_ranks", "log_details",
                     "process_group")


def check_options(method: str, options: dict) -> None:
    """The method and its options, checked when an integration is made (before the framework
    wraps the model), so a bad one is named at once; register()'s own keywords pass through."""
    from ..hooks.options import build_config, is_auto, merge_options

    opts = {k: v for k, v in options.items() if k not in REGISTER_KEYWORDS}
    if is_auto(method):  # the shared options (the optimizer is not known yet here)
        from ..hooks.auto import configs
        configs(merge_options(method, opts, auto=True)[1], None)
        return
    build_config(method, **opts)


def single_process_warning(framework: str) -> None:
    warnings.warn(f"gradcomp with {framework}: this job is not distributed (one process): "
                  f"nothing is exchanged, so gradcomp is not registered and the run is "
                  f"the plain one", UserWarning, stacklevel=3)
