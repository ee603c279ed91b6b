"""Hugging Face Accelerate: after ``accelerator.prepare(...)``, one line::

    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = gradcomp.integrations.accelerate.register(accelerator, model, "onebit", optimizer=opt)

``prepare`` wraps the model in DDP when the job has several processes; this registers the
method on it with the prepared optimizer (an ``AcceleratedOptimizer``: gradcomp binds the
torch optimizer inside it) and hands the state to ``accelerator.register_for_checkpointing``
(every rank's state, gathered onto rank 0: ``State.all_ranks()``), so that
``accelerator.save_state`` / ``load_state`` carry it. Gradient accumulation through
``accelerator.accumulate(model)`` works as in DDP: the micro-steps run under ``no_sync``.
``gradcomp.register(model, ...)`` on the prepared model works as well; it then leaves the
checkpointing to you (``accelerator.register_for_checkpointing(state.all_ranks())``).
"""
from __future__ import annotations

from ..hooks.register import register as _register
from . import check_model, distributed, single_process_warning


def register(accelerator, model, method: str, *, optimizer=None, checkpoint: bool = True,
             **options):
    """Register ``method`` on the prepared ``model`` (``options`` as for
    :func:`gradcomp.register`) and, with ``checkpoint``, put its state in the accelerator's
    checkpoints. Returns the state (None in a single process: nothing to compress)."""
    if not distributed():
        single_process_warning("Accelerate")
        return None
    check_model(model, "the prepared model", "Accelerate")
    state = _register(model, method, optimizer=optimizer, **options)
    if checkpoint:
        accelerator.register_for_checkpointing(state.all_ranks())
    return state
