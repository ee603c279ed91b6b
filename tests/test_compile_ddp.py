"""``torch.compile`` on a DDP model with a gradcomp hook (users ask for it: pytorch#109697,
#109774). ``torch.compile(ddp_model)`` splits the graph at DDP's buckets (DDPOptimizer) and
the backward still runs DDP's reducer, so the hook runs as in eager: equal to eager bit for
bit (the ``aot_eager`` backend, which traces as inductor does without generating C++, keeps
this test fast; inductor's kernels may round differently from eager's). Compiled autograd
replaces DDP's reducer by its own, which runs no comm hook: ``register`` refuses it with a
clear error instead of training silently uncompressed."""
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from conftest import batch, small_net


def _net():
    """Wide enough for 2 DDP buckets at 1 MB, the smallest cap DDPOptimizer takes (it wants
    no bucket smaller than its 1 MB first one): the last two layers, then the first."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 512), nn.ReLU(), nn.Linear(512, 512), nn.Tanh(),
                         nn.Linear(512, 10))


def _train(rank, world, spec, compiled, steps=6):
    torch._dynamo.reset()
    net = _net()
    model = DDP(net, bucket_cap_mb=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=64, warmup="none")
    run = torch.compile(model, backend="aot_eager") if compiled else model
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(run(x), y).backward()
        opt.step()
    stats = state.stats()
    out = {"params": [p.detach().clone() for p in net.parameters()],
           "sent": stats["sent_bytes"], "raw": stats["raw_bytes"],
           "since": stats["compressing_since"], "buckets": len(state._state.layouts)}
    state.close()
    return out


def _pair(rank, world, spec):
    return _train(rank, world, spec, False), _train(rank, world, spec, True)


@pytest.mark.parametrize("spec", ["onebit", "topk", "dgc"])
def test_compiled_ddp_model_equals_eager(spawn, spec):
    for eager, compiled in spawn(_pair, 2, args=(spec,), timeout=300):
        assert compiled["sent"] < compiled["raw"]  # the hook ran, compressed
        assert eager["since"] == compiled["since"] == 0  # every step
        assert eager["buckets"] == compiled["buckets"] == 2
        for a, b in zip(eager["params"], compiled["params"]):
            assert torch.equal(a, b)


def _compiled_autograd(rank, world, mode):
    old = (torch._dynamo.config.compiled_autograd, torch._dynamo.config.optimize_ddp)
    if mode == "config":
        torch._dynamo.config.compiled_autograd = True
    else:  # compiled autograd's own DDP reducer, chosen when DDP is built
        torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        net = small_net()
        model = DDP(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        gradcomp.register(model, "onebit", optimizer=opt)
    except (TypeError, ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    finally:
        torch._dynamo.config.compiled_autograd, torch._dynamo.config.optimize_ddp = old
    return None


@pytest.mark.parametrize("mode", ["config", "python_reducer"])
def test_compiled_autograd_is_refused_naming_what_to_do(spawn, mode):
    """Under it DDP's Python reducer calls the hook without a GradBucket (measured: a
    TypeError deep in torch at the first backward): refused at registration instead."""
    for out in spawn(_compiled_autograd, 2, args=(mode,), timeout=120):
        assert out is not None and out[0] == "ValueError", out
        assert "compiled_autograd=False" in out[1] and "torch.compile(ddp_model)" in out[1]
