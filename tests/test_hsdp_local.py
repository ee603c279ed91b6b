"""Local steps under HSDP (hooks/fsdp.py, hooks/local_steps.py): 2 replicas x 2 shards, gloo,
CPU. Inner steps keep the node's average; every H steps each rank's rows go through the
method across their replicas (DiLoCo over FSDP2, as INTELLECT-1). The one-line named methods
with AdamW; the refusal on a 1-D mesh."""
import pytest
import torch

import gradcomp
from test_fsdp import _local, _net, _replicas_agree, _train

pytestmark = pytest.mark.filterwarnings("ignore")


def _named(rank, world, spec):
    """A named method in one line with AdamW: the replicas agree at every round's end and
    differ inside a round; it compressed; the trainable values moved."""
    net = _net(world, True)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    state = gradcomp.register(net, spec, optimizer=opt)
    H, S = state.config.local_steps, state.config.sync_steps
    start = _local(net)
    synced = []  # sync_steps: the replicas agree after each synchronous step
    for s in range(S):
        _train(net, opt, rank, range(s, s + 1))
        synced.append(_replicas_agree(net, state))
    _train(net, opt, rank, range(S, S + H))
    agree_edge = _replicas_agree(net, state)
    _train(net, opt, rank, range(S + H, S + H + 1))
    agree_inside = _replicas_agree(net, state)
    _train(net, opt, rank, range(S + H + 1, S + 2 * H))
    agree_second = _replicas_agree(net, state)
    moved = any(not torch.equal(a, b) for a, b in zip(start, _local(net)))
    stats = state.stats()
    state.close()
    return (agree_edge, agree_inside, agree_second, moved, stats["run_ratio"], state.step,
            synced)


@pytest.mark.parametrize("spec", ["sparseloco:local_steps=3,chunk=64,k=8,min_numel=0",
                                  "diloco:local_steps=3,chunk=16,sync_steps=2,dense_wire=int4"])
def test_named_methods_run_across_replicas_in_one_line(spawn, spec):
    for edge, inside, second, moved, ratio, step, synced in spawn(_named, 4, args=(spec,),
                                                                   timeout=300):
        assert synced == ([True, True] if "sync_steps" in spec else []), synced
        assert edge and second, "replicas differ after a round"
        assert not inside, "replicas agree inside a round: the inner steps were averaged"
        assert moved and step == 2
        assert ratio > 2, ratio  # what the rounds sent against their dense size


def _refused(rank, world):
    net = _net(world, False)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    try:
        gradcomp.register(net, "sparseloco", optimizer=opt)
    except ValueError as exc:
        return str(exc)
    return None


def test_local_steps_on_a_one_dimensional_mesh_are_refused_on_every_rank(spawn):
    for msg in spawn(_refused, 2, timeout=120):
        assert msg and "local_steps" in msg and "HSDP" in msg, msg
