"""Lightning: ``Trainer(strategy="ddp", callbacks=[GradcompCallback("onebit")])``.

The callback registers the method on the model Lightning wrapped in DDP (or sharded with
FSDP2) once it exists (``on_fit_start``), with the optimizer Lightning configured (the first
of ``configure_optimizers``, or ``optimizer_index``), and keeps the gradcomp state in
Lightning's own checkpoints: ``ModelCheckpoint``'s files and ``trainer.save_checkpoint``
hold every rank's state (gathered onto rank 0, ``State.all_ranks()``), and
``trainer.fit(..., ckpt_path=...)`` puts each rank's back. ``accumulate_grad_batches`` works
as in DDP (the micro-steps run under ``no_sync``), and so does automatic optimization, whose
backward runs inside ``optimizer.step(closure)``. Lightning registers its own
``ddp_comm_hook`` argument on CUDA only; this callback works on every device.
"""
from __future__ import annotations

import warnings

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback

from ..hooks.register import register
from . import check_model, check_options, distributed, single_process_warning


class GradcompCallback(Callback):
    """Register ``method`` (a name or spec, ``options`` as for :func:`gradcomp.register`) on
    the model the strategy wrapped. ``state``: the registered State (None before
    ``fit`` starts, or on a single device)."""

    def __init__(self, method: str, *, optimizer_index: int = 0, **options):
        check_options(method, options)  # bad options: named now
        if isinstance(optimizer_index, bool) or not isinstance(optimizer_index, int) \
                or optimizer_index < 0:
            raise ValueError(f"invalid optimizer_index={optimizer_index!r}: allowed the index "
                             f"of an optimizer returned by configure_optimizers (0 or more)")
        self.method, self.options, self.optimizer_index = method, options, optimizer_index
        self.state = None
        self._pending = None  # a checkpoint's state, loaded once the state exists

    @property
    def state_key(self) -> str:
        return f"GradcompCallback[{self.method}]"

    def on_fit_start(self, trainer, pl_module) -> None:
        if not distributed():
            single_process_warning("Lightning")
            return
        model = trainer.strategy.model
        check_model(model, "trainer.strategy.model", "Lightning")
        if self.state is not None:  # fit() again: the strategy wrapped the model anew
            self.state.close()
        optimizers = trainer.optimizers
        if self.optimizer_index >= max(len(optimizers), 1):
            raise ValueError(f"optimizer_index={self.optimizer_index}: configure_optimizers "
                             f"returned {len(optimizers)} optimizer(s)")
        optimizer = optimizers[self.optimizer_index] if optimizers else None
        self.state = register(model, self.method, optimizer=optimizer, **self.options)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.state.all_ranks().load_state_dict(pending)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.state_key not in checkpoint.get("callbacks", {}):
            warnings.warn(f"gradcomp: the checkpoint Lightning resumes from holds no "
                          f"{self.state_key} state (saved without it): {self.method} starts "
                          f"with a fresh state (no residuals, warm-up from the start)",
                          UserWarning, stacklevel=2)

    def state_dict(self) -> dict:
        # every rank calls this while Lightning dumps a checkpoint: the gather is collective
        if self.state is None:
            return {}
        return self.state.all_ranks().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if self.state is None:
            self._pending = state_dict  # restored before the strategy wraps the model
        else:
            self.state.all_ranks().load_state_dict(state_dict)
