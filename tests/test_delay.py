"""Delayed gradient averaging (Zhu et al., NeurIPS 2021): delay=D applies the local gradient
at once and the correction (average - local) D steps later; flush() applies the rest."""
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp_bench.train import train
from conftest import batch, small_net, train_pair

LR = 0.05


def _delayed_run(rank, world, spec, steps):
    net = small_net()
    p0 = [p.detach().clone() for p in net.parameters()]
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, warmup="none")
    local = [torch.zeros_like(p, dtype=torch.float64) for p in net.parameters()]
    hooks = []
    for i, p in enumerate(net.parameters()):
        def cap(g, i=i):
            local[i].add_(g.double())
        hooks.append(p.register_hook(cap))
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    corr = state.flush()
    if corr:
        opt.step()
    mem = state.state_dict()["memory"]["flat"].get("residual", {})
    names = [n for n, _ in net.named_parameters()]
    left = [mem[n].double().view_as(l) if n in mem else torch.zeros_like(l)
            for n, l in zip(names, local)]
    moved = [(a - p.detach()).double() for a, p in zip(p0, net.parameters())]
    return moved, local, left, len(corr), state.stats()


@pytest.mark.parametrize("spec", ["allreduce:delay=2", "topk:ratio=0.1,delay=1"])
def test_after_flush_the_updates_sum_to_the_averages(spec, spawn):
    """topk: compressed from the first step, over several buckets; allreduce: delayed plain
    averaging (nothing compressed, on purpose)."""
    (m0, l0, r0, n0, st), (m1, l1, r1, _, _) = spawn(_delayed_run, 2, args=(spec, 7))
    assert n0 > 0  # flush had corrections in flight
    if spec.startswith("topk"):
        assert st["compressing_since"] == 0 and st["run_ratio"] > 1.5
    for a, b, g0, g1, e0, e1 in zip(m0, m1, l0, l1, r0, r1):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)   # ranks agree after flush
        expect = LR * ((g0 - e0) + (g1 - e1)) / 2
        torch.testing.assert_close(a, expect, atol=1e-5, rtol=1e-4)


def test_delay_zero_is_bit_identical_to_synchronous(spawn):
    """Plain allreduce on purpose: delay=0 must give the synchronous run itself (the
    compressing methods run delay=0, their default, in every other equality test)."""
    a, b = spawn(train_pair, 2, args=("allreduce:delay=0", {"lr": LR, "momentum": 0.9}, 4,
                                       "allreduce"))[0]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _train_delays(rank, world, specs):
    out = {}
    for s in specs:
        method, delay = s.split("|")
        options = {"delay": int(delay)} | ({} if method == "allreduce" else {"warmup": "none"})
        r = train(rank, world, dict(method=method, max_steps=24, epochs=0, eval=False,
                                    options=options))
        out[s] = r["losses"], r["stats"]["compressing_since"]
    return out


def test_training_with_delay_lowers_the_loss(cifar, spawn):
    """onebit compressed from the first step (its default warm-up would keep these 24 steps
    dense)."""
    got = spawn(_train_delays, 2, args=(["allreduce|1", "allreduce|2", "onebit|2"],), timeout=600)[0]
    for s, (ls, since) in got.items():
        assert since == (None if s.startswith("allreduce") else 0), s
        first, last = sum(ls[:6]) / 6, sum(ls[-6:]) / 6
        assert last < first - 0.1, f"{s}: {first:.3f} -> {last:.3f}"


def _lanes_run(rank, world, spec, lanes):
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, warmup="none", lanes=lanes)
    for step in range(6):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.zero_grad()
    if state.flush():
        opt.step()
    return [p.detach().clone() for p in net.parameters()], state._state.lanes, state.stats()


@pytest.mark.parametrize("spec", ["powersgd:rank=1", "onebit:chunk=64,delay=2", "dgc:ratio=0.05,delay=1"])
def test_buckets_in_flight_together_give_the_same_result(spec, spawn):
    """Lanes run different buckets' exchanges at once; a bucket's steps stay in order, so the
    result is bit-identical to one lane (also across DDP's bucket rebuild under delay).
    Compressed from the first step."""
    one, n1, s1 = spawn(_lanes_run, 2, args=(spec, 1))[0]
    many, n4, s4 = spawn(_lanes_run, 2, args=(spec, 4))[0]
    assert (n1, n4) == (1, 4)
    assert s1["compressing_since"] == s4["compressing_since"] == 0
    assert s1["run_ratio"] > 1.5 and s4["run_ratio"] > 1.5
    assert all(torch.equal(a, b) for a, b in zip(one, many))


def _bad_lanes(rank, world):
    try:
        gradcomp.register(DDP(small_net()), "onebit", lanes=0)
    except ValueError as exc:
        return str(exc)


def test_bad_lanes_value_is_refused(spawn):
    assert all("invalid lanes=0" in m for m in spawn(_bad_lanes, 2))
