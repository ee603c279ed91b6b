"""How far two runs of the same algorithm drift apart: plain DDP against a gradcomp spec that
computes the same update in another order of float operations (e.g.
``dgc:ratio=1,masking=false``: momentum SGD with the momentum in the hook). 2 gloo ranks,
the accuracy issue's model and optimizer (``resnet18_narrow``, SGD lr 0.1 Nesterov momentum
0.9 weight decay 5e-4, OneCycleLR over the run), random inputs, DDP's defaults; after each
run length it prints the largest relative parameter difference and the last step's loss
difference.

    PYTHONPATH=. python bench/same_algorithm.py --steps 1,2,3,40 dgc:ratio=1,masking=false,warmup=none

A difference in the last bits after a few steps that grows to O(1) later is float rounding
amplified by training, the noise floor of a single-seed comparison, not a wrong update.
"""
from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp_bench.models import build


def _run(rank, world, port, spec, steps, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = build("resnet18_narrow")
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    if spec:
        gradcomp.register(model, spec, optimizer=opt)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=steps)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    if rank == 0:
        torch.save((losses, [p.detach().clone() for p in net.parameters()]), out)
    dist.destroy_process_group()


def _job(spec, steps, out):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_run, args=(2, port, spec, steps, out), nprocs=2, start_method="spawn")
    return torch.load(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("specs", nargs="+")
    p.add_argument("--steps", default="1,2,3,40")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "run.pt")
        for steps in (int(v) for v in a.steps.split(",")):
            ref_loss, ref = _job(None, steps, out)
            for spec in a.specs:
                loss, got = _job(spec, steps, out)
                rel = max(((x - y).abs().max() / (y.abs().max() + 1e-12)).item()
                          for x, y in zip(got, ref))
                print(f"{spec} steps={steps}: max relative parameter difference {rel:.3g}, "
                      f"last loss difference {loss[-1] - ref_loss[-1]:+.3g}")


if __name__ == "__main__":
    main()
