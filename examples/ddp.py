"""gradcomp in a plain DDP job: one line after wrapping the model.

    torchrun --nproc-per-node 2 examples/ddp.py --method onebit --steps 20

A small causal LM on random tokens, AdamW with param groups; on CPU it uses gloo, on GPUs
NCCL. At the end each rank checks that its parameters equal every other rank's."""
import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp


class TinyLM(nn.Module):
    """Embedding, one pre-norm causal transformer block, a linear head."""

    def __init__(self, vocab, dim=64, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0,
                                                batch_first=True, norm_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        return self.head(self.block(self.embed(tokens), src_mask=mask, is_causal=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="terngrad", help="a gradcomp method or spec")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    vocab = 64
    net = TinyLM(vocab).to(device)
    model = DDP(net, device_ids=[device.index] if cuda else None)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95))

    state = gradcomp.register(model, args.method, optimizer=opt)  # the one line

    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (8, 33), generator=g).to(device)
        out = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(out.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                     for p in net.parameters())).hexdigest()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest)
    if rank == 0:
        s = state.stats()
        phase = "compressing" if s["compressing"] else "dense warm-up"
        print(f"{args.method}: loss {loss.item():.4f}, step {s['step']} ({phase}: "
              f"{s['raw_bytes'] / max(s['sent_bytes'], 1):.1f}x fewer bytes), "
              f"ranks agree: {len(set(every)) == 1}")
    # every rank done with its collectives before any tears its connections down, at
    # each step (gloo aborts a peer whose connection closes under it)
    dist.barrier()
    state.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
