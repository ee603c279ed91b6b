"""gradcomp on a model sharded with FSDP2 (``fully_shard``): the same one line.

    torchrun --nproc-per-node 4 examples/fsdp2.py --method terngrad --ranks-per-node 2

With ``--ranks-per-node`` the mesh is 2-D (HSDP): the reduce-scatter inside a node stays
dense and the all-reduce across nodes goes compressed (docs/fsdp.md)."""
import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradcomp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="terngrad")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ranks-per-node", type=int, default=0, help="HSDP: shard within nodes")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    per = args.ranks_per_node
    mesh = (init_device_mesh(device, (world // per, per), mesh_dim_names=("replicate", "shard"))
            if per else init_device_mesh(device, (world,)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    state = gradcomp.register(model, args.method, optimizer=opt)  # the one line

    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        x = torch.randn(32, 32, generator=g).to(device)
        loss = nn.functional.cross_entropy(model(x), x[:, :10].argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    full = [p.full_tensor() for p in model.parameters()]  # every rank's view of the model
    digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in full)).hexdigest()
    every = [None] * world
    dist.all_gather_object(every, digest)
    if dist.get_rank() == 0:
        print(f"{args.method}: loss {loss.item():.4f}, step {state.step}, "
              f"ranks agree: {len(set(every)) == 1}")
    # every rank done with its collectives before any tears its connections down, at
    # each step (gloo aborts a peer whose connection closes under it)
    dist.barrier()
    state.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
