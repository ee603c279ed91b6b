"""Why the convergence recipe runs torch's PowerSGD hook with ``ordered=1``.

torch's ``powerSGD_hook`` issues each bucket's P and Q allreduces from the ``.then``
callbacks of the futures before them. On gloo those callbacks run on gloo's threads, so
once DDP has more than one bucket, two ranks can issue the allreduces of different buckets
in different orders. gloo then pairs mismatched collectives and aborts ("op.preamble.length
<= op.nbytes ... collective mismatch") or the ranks wait on each other. Completing each
bucket's future inside the hook (``gradcomp_bench.train._in_order``) keeps one order: the
same arithmetic, one sequence on every rank.

This script runs both forms a few times on 12 Linear(64, 64) layers split into ~6 buckets
(bucket_cap_mb=0.02), 2 gloo ranks, rank 2, PowerSGD from step 2, and prints how each run
ended:

    PYTHONPATH=. python bench/torch_powersgd_gloo.py --trials 3 --steps 300

gradcomp's own hooks do not have the problem: every collective is issued by the thread
that called the hook, in a key order shared by the ranks (gradcomp.comm; tests/test_order.py).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
from torch.nn.parallel import DistributedDataParallel as DDP

from gradcomp_bench.launch import RankError, spawn
from gradcomp_bench.train import _in_order


def _run(rank, world, ordered, steps):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(12)])
    model = DDP(net, bucket_cap_mb=0.02)
    state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                             start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
    model.register_comm_hook(state, _in_order(ps.powerSGD_hook) if ordered else ps.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        model(torch.randn(32, 64, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--timeout", type=float, default=120, help="seconds per run")
    a = ap.parse_args(argv)
    for ordered in (0, 1):
        for t in range(a.trials):
            t0 = time.perf_counter()
            out = spawn(_run, 2, args=(ordered, a.steps), timeout=a.timeout, pg_timeout=30,
                        allow_fail=True)
            bad = [o for o in out if isinstance(o, RankError)]
            if bad:
                first = str(bad[0]).strip().splitlines()
                why = next((ln for ln in first if "mismatch" in ln or "preamble" in ln),
                           first[0] if first else "hung")
                end = f"FAILED ({why.strip()[:120]})"
            else:
                end = f"ok, {a.steps} steps"
            print(f"ordered={ordered} trial {t}: {end} [{time.perf_counter() - t0:.0f}s]", flush=True)


if __name__ == "__main__":
    main()
