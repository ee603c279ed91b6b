"""How much does CPU work on a side thread slow backward on this machine, per ms of its CPU time?

The 100 Mbit/s rig (bench/RESULTS.md, "Speed on a slow link") found backward slower, during the exchanges of the
first buckets, by more than the codec's CPU time. This separates the codec from the question:
2 ranks train ResNet-18 (DDP's defaults, one thread per rank, loopback, no gradient
communication) with a comm hook that hands each bucket to a side thread, which burns a given
CPU time per gradient element (``time.thread_time``) and then returns the bucket unchanged:

* ``none``: nothing burnt (the rig's ``noop``);
* ``compute``: arithmetic on a 64 KB tensor (stays in the core's cache);
* ``stream``: copies between two 45 MB buffers (memory traffic, as a codec's passes);
* ``codec:METHOD``: the method's own exchange (warm-up off) on a process group of this rank
  alone: its codec, no wire;

and reports per kind the median backward time and the side thread's CPU time per step.
If backward grows by about the burnt time, a codec costs its CPU time and no more; if it
grows by more for ``stream`` than for ``compute``, memory traffic is what costs.

    python bench/interference.py --ns 15 --steps 12
"""
from __future__ import annotations

import argparse
import json
import queue
import statistics
import threading
import time

import torch


def _burn(kind: str, seconds: float, small, big):
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        if kind == "compute":
            for _ in range(20):
                small.mul_(1.0000001).add_(1e-7)
        else:
            big[1].copy_(big[0])


def run(rank: int, world: int, kind: str, ns: float, steps: int, warmup: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from gradcomp_bench import models

    torch.manual_seed(0)
    net = DDP(models.build("resnet18"))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    small = torch.rand(16384)
    big = (torch.rand(11_200_000), torch.empty(11_200_000))
    jobs: queue.Queue = queue.Queue()
    cpu = [0.0]
    state = None
    if kind.startswith("codec:"):  # the method's exchange on a group of this rank alone
        import gradcomp
        from gradcomp.hooks.delayed import flat_slices
        alone = [dist.new_group([r]) for r in range(world)][rank]
        names = {id(p): n for n, p in net.module.named_parameters()}
        from gradcomp.compressors import METHODS
        cfg = METHODS[kind[6:]].config(warmup="none")
        state = gradcomp.State(kind[6:], cfg, group=alone, param_names=names,
                               param_numels={n: p.numel() for n, p in net.module.named_parameters()})

    def worker():
        while True:
            job = jobs.get()
            if job is None:
                return
            fut, buf = job[:2]
            c0 = time.thread_time()
            if state is not None:
                params = job[2]
                state.reduce(buf, flat_slices([(names[id(p)], p) for p in params]), job[3])
            elif kind != "none":
                _burn(kind, ns * 1e-9 * buf.numel(), small, big)
            cpu[0] += time.thread_time() - c0
            fut.set_result(buf)

    th = threading.Thread(target=worker, daemon=True)
    th.start()

    def hook(_, bucket):
        fut = torch.futures.Future()
        jobs.put((fut, bucket.buffer(), bucket.parameters(), bucket.index()))
        return fut

    net.register_comm_hook(None, hook)
    x = torch.randn(32, 3, 32, 32)
    y = torch.randint(0, 10, (32,))
    rows = []
    for s in range(warmup + steps):
        dist.barrier()
        cpu[0] = 0.0
        t0 = time.perf_counter()
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if s >= warmup:
            rows.append({"forward_s": t1 - t0, "backward_s": t2 - t1, "step_s": t3 - t0,
                         "side_cpu_s": cpu[0]})
    jobs.put(None)
    th.join()
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    from gradcomp_bench.launch import spawn
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="none,compute,stream,none,compute,stream")
    ap.add_argument("--ns", type=float, default=15.0, help="CPU ns burnt per gradient element")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = []
    for kind in args.kinds.split(","):
        res = spawn(run, 2, args=(kind, args.ns, args.steps, args.warmup), timeout=900)
        row = {"kind": kind, **{k: statistics.mean(r[k] for r in res) for k in res[0]}}
        out.append(row)
        print(f"{kind:8s} step {row['step_s'] * 1e3:6.0f} ms  forward {row['forward_s'] * 1e3:5.0f}"
              f"  backward {row['backward_s'] * 1e3:6.0f}  side thread CPU {row['side_cpu_s'] * 1e3:5.0f}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": vars(args), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
