"""gradcomp in an Accelerate job: one line after ``prepare``.

    accelerate launch --num_processes 2 --cpu examples/accelerate_ddp.py --method dgc
    torchrun --nproc-per-node 2 examples/accelerate_ddp.py --method dgc

``register`` puts gradcomp's state in ``accelerator.save_state`` / ``load_state``."""
import argparse
import hashlib

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from gradcomp.integrations.accelerate import register


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="dgc")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save", help="a folder for accelerator.save_state at the end")
    args = ap.parse_args()
    acc = Accelerator(gradient_accumulation_steps=2, cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :10].argmax(1)),
                                         batch_size=32)
    model, opt, loader = acc.prepare(model, opt, loader)
    state = register(acc, model, args.method, optimizer=opt)  # the one line
    for i, (xb, yb) in zip(range(2 * args.steps), loader):
        with acc.accumulate(model):
            acc.backward(nn.functional.cross_entropy(model(xb), yb))
            opt.step()
            opt.zero_grad()
    if args.save:  # gradcomp's state goes with the model's and the optimizer's
        acc.save_state(args.save)
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                     for p in acc.unwrap_model(model).parameters())).hexdigest()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    if acc.is_main_process:
        print(f"{args.method}: step {state.step}, ranks agree: {len(set(every)) == 1}")
    # every rank done with its collectives before any tears its connections down, at each
    # step (gloo aborts a peer whose connection closes under it)
    dist.barrier()
    state.close()  # its threads and process groups, before the job's own go
    dist.barrier()
    acc.end_training()  # destroys the process group on every rank


if __name__ == "__main__":
    main()
