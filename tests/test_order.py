"""One global collective order, identical on every rank, whatever the threads' timing (what
NCCL needs: operations on several communicators launched in one order everywhere).

A test-only wrapper delays every collective gradcomp issues by a random 0-3 ms (different
on each rank) and records each rank's global sequence of (process group, op, size). Every
method, 4 lanes, delay 0 and 1, tiny buckets (several per step, and DDP's bucket rebuild
after the first iteration): the sequences must be identical across ranks. Before the engine
issued collectives by ticket, powersgd's sequences differed from about the 5th collective.
The methods compress from the first step (``warmup=none``); the adaptive warm-up's runs
(window 1: a window's allreduce every step until the switch) add its collective.
"""
import random
import threading
import time

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.hooks.engine import Sequencer
from conftest import batch, record_collectives, small_net

SPECS = ["allreduce", "topk:ratio=0.05", "dgc:ratio=0.05", "onebit:chunk=64", "terngrad",
         "powersgd:rank=1", "threshold"]
RUNS = [f"{s},delay={d},warmup=none" if ":" in s else f"{s}:delay={d},warmup=none"
        for s in SPECS for d in (0, 1)]
RUNS += [f"{s},delay={d},warmup_window=1,warmup_threshold=100"
         for s in ("onebit:chunk=64", "powersgd:rank=1", "dgc:ratio=0.05") for d in (0, 1)]


def _sequences(rank, world):
    log = record_collectives(rank)
    out = {}
    for spec in RUNS:
        net = small_net()
        model = DDP(net, bucket_cap_mb=0.004)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, lanes=4)
        start = len(log)
        for step in range(4):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        state.drain()
        out[spec] = log[start:]
        state.close()
    return out


@pytest.fixture(scope="module")
def sequences(spawn):
    return spawn(_sequences, 2, timeout=600)


@pytest.mark.parametrize("spec", RUNS)
def test_every_rank_issues_the_same_global_sequence(sequences, spec):
    a, b = (s[spec] for s in sequences)
    assert len({g for g, _, _ in a}) > 1, "several lanes were in use"
    assert len(a) == len(b)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    assert first is None, f"rank sequences differ from collective {first}: {a[first]} vs {b[first]}"


def test_sequencer_grants_turns_in_key_order_whatever_the_threads_do():
    """Four lanes' threads ask for their phases in random order; the order granted is
    (round, bucket // lanes, phase, bucket % lanes), with later buckets submitted late."""
    seq, got, lock = Sequencer(lanes=2), [], threading.Lock()
    rng = random.Random(0)
    phases = {0: 2, 1: 1, 2: 3, 3: 2, 4: 1}  # bucket -> collectives in its exchange

    def exchange(rnd, bucket):
        for p in range(phases[bucket]):
            time.sleep(rng.uniform(0, 0.002))
            with seq.turn(rnd, bucket, p, timeout=10):
                with lock:
                    got.append((rnd, bucket, p))
        seq.close(rnd, bucket)

    threads = []
    for rnd in range(2):
        for b in range(5):
            r = seq.open(b, last=b == 4)
            assert r == rnd
            t = threading.Thread(target=exchange, args=(rnd, b))
            t.start()
            threads.append(t)
            time.sleep(rng.uniform(0, 0.002))
    for t in threads:
        t.join(10)
    want = sorted(((r, b, p) for r in range(2) for b in range(5) for p in range(phases[b])),
                  key=lambda k: (k[0], k[1] // 2, k[2], k[1] % 2))
    assert got == want


def _torch_powersgd_sequence(rank, world, spec):
    from gradcomp_bench.train import attach
    log = record_collectives(rank)
    model = DDP(small_net(), bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    attach(model, spec, opt)
    for step in range(8):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return log, sum(p.detach().double().sum().item() for p in model.parameters())


def test_torch_powersgd_baseline_in_order_issues_one_sequence_on_gloo(spawn):
    """The convergence recipe's torch-powersgd row (``ordered=1``): torch's hook issues its P
    and Q allreduces from future callbacks, which on gloo run on gloo's threads; with several
    buckets and the random delays above, two ranks then issue them in different orders and
    gloo aborts (bench/torch_powersgd_gloo.py). Completed inside the hook they keep one order."""
    (a, pa), (b, pb) = spawn(_torch_powersgd_sequence, 2,
                             args=("torch-powersgd:rank=1,start=2,ordered=1",), timeout=120)
    assert len(a) == len(b) > 6 * 3, "several buckets' P and Q allreduces every step"
    assert a == b
    assert pa == pb  # the ranks' models stay identical
