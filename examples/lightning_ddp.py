"""gradcomp in a Lightning job: one callback.

    torchrun --nproc-per-node 2 examples/lightning_ddp.py --method onebit --steps 20

(or `python examples/lightning_ddp.py`: Lightning then starts the processes itself.) The
callback registers the method on the model Lightning wraps in DDP, with the optimizer from
``configure_optimizers``, and keeps gradcomp's state in Lightning's checkpoints."""
import argparse
import hashlib

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from gradcomp.integrations.lightning import GradcompCallback


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, i):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="onebit")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, :10]).argmax(1))
    loader = torch.utils.data.DataLoader(data, batch_size=32)
    cb = GradcompCallback(args.method)  # the one line
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps,
                         accumulate_grad_batches=2, callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = Classifier()
    trainer.fit(module, loader)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in module.parameters())).hexdigest()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    if trainer.is_global_zero:
        print(f"{args.method}: step {cb.state.step}, ranks agree: {len(set(every)) == 1}")


if __name__ == "__main__":
    main()
