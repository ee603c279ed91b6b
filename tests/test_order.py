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

# allreduce: the plain exchange's order, on purpose (nothing compressed); the others compress
SPECS = ["allreduce", "topk:ratio=0.05", "dgc:ratio=0.05", "onebit:chunk=64", "terngrad",
         "powersgd:rank=1", "threshold"]
RUNS = [f"{s},delay={d},warmup=none" if ":" in s else f"{s}:delay={d},warmup=none"
        for s in SPECS for d in (0, 1)]
RUNS += [f"{s},delay={d},warmup_window=1,warmup_threshold=100"
         for s in ("onebit:chunk=64", "powersgd:rank=1", "dgc:ratio=0.05") for d in (0, 1)]


def _sequences(rank, world, ordered=True):
    """Per run: its collectives, and the first compressed step (None: never compressed)."""
    log = record_collectives(rank)
    out, since = {}, {}
    for spec in RUNS:
        net = small_net()
        model = DDP(net, bucket_cap_mb=0.004)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, lanes=4)
        if ordered is not None:  # gloo's default is False (test_gloo_... below)
            state.ordered = ordered
        start = len(log)
        for step in range(4):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        state._state.drain()
        out[spec] = log[start:]
        since[spec] = state.stats()["compressing_since"]
        assert state.ordered is (ordered if ordered is not None else False)
        state.close()
    return out, since


def _first_compressed(spec):
    """The step ``spec`` compresses from in these 4 steps: warmup=none the first, the
    adaptive runs' window 1 and eta 100 the earliest switch (2 windows); allreduce never."""
    return None if spec.startswith("allreduce") else 0 if "warmup=none" in spec else 2


@pytest.fixture(scope="module")
def sequences(spawn):
    return spawn(_sequences, 2, timeout=600)


def _by_group(log):
    out = {}
    for g, op, n in log:
        out.setdefault(g, []).append((op, n))
    return out


def _group_sequences(rank, world):
    out, since = _sequences(rank, world, ordered=None)
    return {spec: _by_group(log) for spec, log in out.items()}, since


def test_gloo_issues_without_turns_each_groups_sequence_the_same_on_every_rank(spawn):
    """On gloo the default is no global order (``state.ordered`` False, asserted in
    _sequences): what gloo needs is that each process group sees one sequence on every rank
    (each lane's group is used by its thread alone), which holds under the same random
    delays."""
    (a, sa), (b, sb) = spawn(_group_sequences, 2, timeout=600)
    for spec in RUNS:
        assert sa[spec] == sb[spec] == _first_compressed(spec), spec
        assert len(a[spec]) > 1, "several lanes were in use"
        assert a[spec] == b[spec], spec


@pytest.mark.parametrize("spec", RUNS)
def test_every_rank_issues_the_same_global_sequence(sequences, spec):
    a, b = (s[spec] for s, _ in sequences)
    assert all(since[spec] == _first_compressed(spec) for _, since in sequences)
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


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes 0.4 s: the first layer's gradients (DDP's last bucket)
    come that long after the later layers'."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.4)
        return g


class _SlowNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.rest = small_net()[0], small_net()[1:]

    def forward(self, x):
        return self.rest(_SlowBackward.apply(self.first(x)))


def _first_bucket_done(rank, world, ordered):
    """Per step after the first: did bucket 0's exchange (1-bit's two collectives) finish
    before DDP handed over its last bucket?"""
    model = DDP(_SlowNet(), bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = gradcomp.register(model, "onebit:chunk=64,warmup=none", optimizer=opt, min_numel=0)
    if ordered is not None:
        state.ordered = ordered
    out = []
    for step in range(3):
        x, y = batch(rank, step)
        opt.zero_grad()
        state.trace = []
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ev, state.trace = state.trace, None
        last = max(a for k, b, a, z in ev if k == "submit")
        end0 = next(z for k, b, a, z in ev if k == "exchange" and b == 0)
        if step:  # DDP rebuilds its buckets after the first iteration
            out.append(end0 < last)
    n = len({b for k, b, a, z in ev if k == "submit"})
    since = state.stats()["compressing_since"]
    state.close()
    return out, n, state.ordered, since


@pytest.mark.parametrize("ordered", [None, True])
def test_on_gloo_a_buckets_exchange_finishes_while_backward_goes_on(spawn, ordered):
    """gloo's default (no global order): bucket 0's two-phase exchange finishes while backward
    still computes the first layer (0.4 s later). In the global order (NCCL's) its second
    collective waits for the group's last bucket, handed over at backward's end."""
    (done, buckets, got, since), _ = spawn(_first_bucket_done, 2, args=(ordered,), timeout=120)
    assert since == 0  # the two-phase exchange, not the dense warm-up's one allreduce
    assert 1 < buckets <= 4, "one group of buckets (lanes=4)"
    assert got is (ordered or False)
    assert done == [not ordered] * 2
