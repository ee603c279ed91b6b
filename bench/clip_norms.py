"""What a gradient-norm clip sees in a compressed step, against the exact average's norm.

The GPT of ``gradcomp-bench convergence --model gpt`` (AdamW, the linear warm-up and cosine
schedule of a 600-step run, clip 1.0) on 2 gloo ranks, the method compressing from step
``--dense-steps``. Each step every rank also runs its batch through a copy of the model to
get its own gradient g_i; printed per 20 steps (means), rank 0:

  exact      ||mean_i g_i||, the allreduce's gradient (a dense all-reduce of the copies)
  exchanged  ||h||, what the method handed back: what the user's clip sees
  own        sqrt(mean_i ||g_i||^2), the ranks' own gradients' norm
  inner      sqrt(<mean_i g_i, h>)

    python bench/clip_norms.py --method onebit --steps 200 --dense-steps 60
"""
from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp_bench import data, models
from gradcomp_bench.train import lm_schedule


def _run(rank, world, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train, _ = data.load_text(None)
    net, twin = models.build("gpt"), models.build("gpt")
    model = DDP(net)
    opt = torch.optim.AdamW(models.decay_groups(net, 0.1), lr=1e-3, betas=(0.9, 0.95))
    gradcomp.register(model, args.method, optimizer=opt, dense_steps=args.dense_steps)
    sched = lm_schedule(opt, 600, 30)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    rows = []
    for _ in range(args.steps):
        starts = torch.randint(0, len(train) - net.context - 1, (16,), generator=gen)
        x, y = data.windows(train, starts, net.context)
        twin.load_state_dict(net.state_dict())
        twin.zero_grad()
        F.cross_entropy(twin(x).flatten(0, 1), y.flatten()).backward()
        g = torch.cat([p.grad.reshape(-1) for p in twin.parameters()]).double()
        avg = g.clone()
        dist.all_reduce(avg)
        avg /= world
        own = g.square().sum()
        dist.all_reduce(own)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        h = torch.cat([p.grad.reshape(-1) for p in net.parameters()]).double()
        inner = (avg * h).sum()
        rows.append((float(avg.norm()), float(h.norm()), math.sqrt(float(own) / world),
                     math.copysign(math.sqrt(abs(float(inner))), float(inner))))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    if rank == 0:
        print(f"{args.method}, compressed from step {args.dense_steps}")
        print("steps     exact  exchanged  own    inner")
        for a in range(0, args.steps, 20):
            seg = rows[a : a + 20]
            print(f"{a:>3}-{a + len(seg) - 1:<4}", *(f"{sum(r[i] for r in seg) / len(seg):.3f}"
                                                for i in range(4)))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="onebit")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dense-steps", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=29741)
    args = p.parse_args()
    mp.spawn(_run, args=(2, args), nprocs=2)


if __name__ == "__main__":
    main()
