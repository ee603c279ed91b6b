"""Hugging Face ``transformers.Trainer``: one line before ``train()``::

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    gradcomp.integrations.hf.register(trainer, "terngrad")
    trainer.train()

The Trainer wraps the model in DDP (``trainer.model_wrapped``) when the job has several
processes, inside ``train()``; a ``TrainerCallback`` registers the method on it when training
begins, with the Trainer's optimizer (an ``AcceleratedOptimizer``: gradcomp binds the torch
optimizer inside it). Each Trainer checkpoint (``checkpoint-N/``) gets ``gradcomp.pt``, every
rank's state gathered onto rank 0 (``State.all_ranks()``), and
``trainer.train(resume_from_checkpoint=...)`` (a path, or True for the latest) puts each
rank's back. Gradient accumulation works as in DDP (``no_sync`` micro-steps).
"""
from __future__ import annotations

import os
import warnings

import torch
from transformers import TrainerCallback

from ..hooks.register import register as _register
from . import check_model, check_options, distributed, single_process_warning

FILE = "gradcomp.pt"


class GradcompTrainerCallback(TrainerCallback):
    """Registers ``method`` on ``trainer.model_wrapped`` at ``on_train_begin`` and keeps the
    state in the Trainer's checkpoints. Made and added by :func:`register`."""

    def __init__(self, trainer, method: str, **options):
        check_options(method, options)  # bad options: named now
        self.trainer, self.method, self.options = trainer, method, options
        self.state = None
        self.resume = None  # the checkpoint train() resumes from (set by register's wrapper)

    def on_train_begin(self, args, state, control, **kwargs):
        if not distributed():
            single_process_warning("the HF Trainer")
            return
        model = self.trainer.model_wrapped
        check_model(model, "trainer.model_wrapped", "the HF Trainer")
        if self.state is not None:  # train() again: the model is wrapped anew
            self.state.close()
        self.state = _register(model, self.method, optimizer=self.trainer.optimizer,
                               **self.options)
        resume = self.resume
        if resume is True:
            from transformers.trainer_utils import get_last_checkpoint
            resume = get_last_checkpoint(args.output_dir)
        if resume:
            path = os.path.join(resume, FILE)
            if not os.path.isfile(path):
                warnings.warn(f"gradcomp: resuming from {resume}, which holds no {FILE} (saved "
                              f"without gradcomp registered): {self.method} starts with a "
                              f"fresh state (no residuals, warm-up from the start)",
                              UserWarning, stacklevel=2)
                return
            self.state.all_ranks().load_state_dict(
                torch.load(path, map_location="cpu", weights_only=True))

    def on_save(self, args, state, control, **kwargs):
        if self.state is None:
            return
        sd = self.state.all_ranks().state_dict()  # collective: every rank runs on_save
        if torch.distributed.get_rank() == 0:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(sd, os.path.join(folder, FILE))


def register(trainer, method: str, **options) -> GradcompTrainerCallback:
    """Add the callback to ``trainer`` (``options`` as for :func:`gradcomp.register`) and
    return it; ``.state`` is the State once ``train()`` has begun."""
    cb = GradcompTrainerCallback(trainer, method, **options)
    trainer.add_callback(cb)
    train = trainer.train

    def train_capturing_resume(resume_from_checkpoint=None, *args, **kwargs):
        cb.resume = resume_from_checkpoint
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_capturing_resume
    return cb
