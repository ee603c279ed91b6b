"""gradcomp in a Hugging Face Trainer job: one line before ``train()``.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --method terngrad --out /tmp/hf-run

Each Trainer checkpoint (``checkpoint-N/``) gets ``gradcomp.pt``, and
``trainer.train(resume_from_checkpoint=...)`` puts it back."""
import argparse
import hashlib

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments

from gradcomp.integrations.hf import register


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="terngrad")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="hf-run")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    rows = [{"x": x[i], "labels": x[i, :10].argmax()} for i in range(len(x))]
    model = Classifier()
    targs = TrainingArguments(output_dir=args.out, max_steps=args.steps,
                              per_device_train_batch_size=32, gradient_accumulation_steps=2,
                              learning_rate=1e-3, save_steps=args.steps, report_to=[],
                              logging_strategy="no", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=model, args=targs, train_dataset=rows)
    cb = register(trainer, args.method)  # the one line
    trainer.train()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    if trainer.is_world_process_zero():
        print(f"{args.method}: step {cb.state.step}, ranks agree: {len(set(every)) == 1}")


if __name__ == "__main__":
    main()
