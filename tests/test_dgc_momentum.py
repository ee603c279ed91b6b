"""DGC's momentum lives in the hook; whatever a scheduler, ``load_state_dict`` or the user
does to the optimizer's param groups, training equals the same job with momentum kept in one
place (plain DDP, momentum in the optimizer). DGC at ratio 1 without masking sends every
element, so it is exactly momentum SGD on the averaged gradient, up to float rounding. It
runs its compressed path (selection, accumulation) from the first step, over several DDP
buckets.

Each scenario failed before the hook read momentum from the optimizer at every step (it
copied it once at registration and zeroed the groups, so OneCycleLR/CyclicLR, a manual change
or a loaded optimizer checkpoint put momentum back into the optimizer: applied twice).
"""
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from conftest import batch, small_net

STEPS = 8
SCENARIOS = ["onecycle", "cyclic", "manual", "load_state_dict", "groups", "scaler", "closure"]


def _optimizer(net, scenario):
    if scenario == "groups":  # no weight decay on biases, different momentum: per parameter
        decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in net.named_parameters() if not n.endswith("weight")]
        return torch.optim.SGD([{"params": decay}, {"params": rest, "weight_decay": 0.0,
                                                    "momentum": 0.5}],
                               lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                           weight_decay=1e-3)


def _run(rank, scenario, spec):
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = _optimizer(model.module, scenario)
    scaler = None
    state = None
    if spec:
        kw = {}
        if scenario == "scaler":
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
            kw["scaler"] = scaler
        state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, warmup="none", **kw)
    elif scenario == "scaler":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    sched = None
    if scenario in ("onecycle", "scaler"):  # created after register, as users write it
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)
    elif scenario == "cyclic":
        sched = torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.1, step_size_up=2,
                                                  base_momentum=0.7, max_momentum=0.9)
    momenta = []
    for step in range(STEPS):
        if scenario == "manual" and step == 3:
            for g in opt.param_groups:
                g["momentum"], g["weight_decay"] = 0.5, 0.0
        if scenario == "load_state_dict" and step == 4:
            sd = opt.state_dict()
            sd["param_groups"][0]["momentum"] = 0.6  # e.g. a checkpoint of another run
            opt.load_state_dict(sd)
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if scaler is not None:
            if step == 2 and rank == 1:
                loss = loss * float("inf")  # one rank overflows: the step is skipped
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        elif scenario == "closure":  # backward inside step(): the groups are zeroed then
            def closure():
                opt.zero_grad()
                out = nn.functional.cross_entropy(model(x), y)
                out.backward()
                return out
            opt.step(closure)
        else:
            loss.backward()
            opt.step()
        if sched is not None:
            sched.step()
        momenta.append(opt.param_groups[0]["momentum"])
    since = state.stats()["compressing_since"] if state else None
    return ([p.detach().clone() for p in net.parameters()], momenta,
            opt.state_dict()["param_groups"], since)


def _compare(rank, world):
    return {s: (_run(rank, s, None), _run(rank, s, "dgc:ratio=1,masking=false"))
            for s in SCENARIOS}


@pytest.fixture(scope="module")
def runs(spawn):
    return spawn(_compare, 2)[0]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_dgc_trains_as_with_momentum_in_one_place(runs, scenario):
    (ref, ref_m, ref_groups, _), (got, got_m, got_groups, since) = runs[scenario]
    assert since == 0  # every step compressed
    # the optimizer's groups show the user's values, as the scheduler set them
    assert got_m == ref_m
    for a, b in zip(ref_groups, got_groups):
        assert {k: b[k] for k in ("momentum", "nesterov", "weight_decay")} == \
               {k: a[k] for k in ("momentum", "nesterov", "weight_decay")}
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)
