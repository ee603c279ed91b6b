"""method="auto" (hooks/auto.py): the candidates per optimizer, the options it takes, the
pick, and a registration on two gloo ranks that probes, agrees and trains."""
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from conftest import small_net, train_steps
from gradcomp.hooks import auto
from gradcomp.hooks import optimizer as optimizer_binding
from gradcomp.hooks.optimizer import held
from gradcomp.hooks.options import parse_spec


def _params():
    return [nn.Parameter(torch.zeros(3))]


def test_candidates_are_allreduce_and_the_methods_that_held_for_the_optimizer():
    sgd = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    assert auto.candidates(sgd) == ["allreduce", "onebit", "powersgd", "terngrad", "topk"]
    assert auto.candidates(None) == auto.candidates(sgd)
    adamw = torch.optim.AdamW(_params())
    assert auto.candidates(adamw) == ["allreduce", *held()]
    assert "terngrad" in auto.candidates(adamw) and "dgc" not in auto.candidates(adamw)


def test_auto_takes_only_the_options_every_method_shares():
    sgd = torch.optim.SGD(_params(), lr=0.1)
    cfgs = auto.configs({"warmup": "none", "seed": 3}, sgd)
    assert list(cfgs) == auto.candidates(sgd)
    assert all(c.warmup == "none" and c.seed == 3 for _, c in cfgs.values())
    with pytest.raises(ValueError, match="ratio.*allowed with auto"):
        auto.configs({"ratio": 0.1}, sgd)
    assert parse_spec("auto:warmup=none", auto=True) == ("auto", {"warmup": "none"})
    with pytest.raises(ValueError, match="unknown method 'auto'"):
        parse_spec("auto")  # only where auto is taken (register)
    with pytest.raises(ValueError, match="unknown option 'rank'"):
        parse_spec("auto:rank=2", auto=True)


def test_pick_is_the_fastest_and_ties_go_to_the_earlier_candidate():
    assert auto.pick({"allreduce": 2.0, "onebit": 0.5, "topk": 0.7}) == "onebit"
    assert auto.pick({"allreduce": 1.0, "onebit": 1.0}) == "allreduce"
    assert auto.pick({"terngrad": 0.3, "topk": 0.3, "allreduce": 0.2}) == "allreduce"


def _register_auto(rank, world, adam):
    net = small_net()
    model = DDP(net)
    opt = (torch.optim.AdamW(net.parameters(), lr=1e-3) if adam
           else torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    state = gradcomp.register(model, "auto:warmup=none" if not adam else "auto", optimizer=opt,
                              min_numel=0)
    H = state.config.local_steps  # a local-steps method: whole rounds, the ranks then agree
    train_steps(model, opt, rank, range(3 if H == 1 else 2 * H))
    probe = state.stats()["method_probe"]
    out = (state.method, probe, [p.detach().clone() for p in net.parameters()],
           auto.candidates(opt))
    state.close()
    return out


@pytest.mark.parametrize("adam", [False, True])
def test_register_auto_probes_every_candidate_and_every_rank_picks_alike(adam, spawn):
    got = spawn(_register_auto, 2, args=(adam,), timeout=240)
    (m0, p0, w0, cands), (m1, p1, w1, _) = got
    assert m0 == m1 == p0["chosen"] == p1["chosen"]
    assert list(p0["seconds"]) == cands and m0 in cands
    assert p0["seconds"] == p1["seconds"]  # the slowest rank's, on both
    assert all(s > 0 for s in p0["seconds"].values())
    assert p0["seconds"][m0] == min(p0["seconds"].values())
    assert p0["predicted_exchange_s_per_step"] >= p0["seconds"][m0] > 0
    for a, b in zip(w0, w1):  # the chosen method trained both ranks alike
        torch.testing.assert_close(a, b)


def _register_bad(rank, world):
    model = DDP(small_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        gradcomp.register(model, "auto", optimizer=opt, **({"ratio": 0.1} if rank == 1 else {}))
    except ValueError as exc:
        return str(exc)
    return None


def test_auto_with_a_methods_own_option_is_refused_on_every_rank(spawn):
    got = spawn(_register_bad, 2, timeout=120)
    assert all(g and "ratio" in g for g in got), got  # rank 0 too: the ranks agreed first


def test_integrations_take_auto_with_the_shared_options_only():
    from gradcomp.integrations import check_options
    check_options("auto", {"warmup": "none", "lanes": 2})
    with pytest.raises(ValueError, match="ratio"):
        check_options("auto", {"ratio": 0.1})


def test_a_compressor_still_defining_prepare_is_refused_at_registration():
    from gradcomp.compressors.base import register_method
    from gradcomp.compressors.topk import TopK

    class Old(TopK):
        name = "old-with-prepare"

        @classmethod
        def prepare(cls, options, optimizer):
            return options
    with pytest.raises(TypeError, match="prepare: no longer called"):
        register_method(Old)


def _register_auto_local(rank, world):
    net = small_net()
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = gradcomp.register(model, "auto", optimizer=opt, local_steps=2, local_delay=1)
    train_steps(model, opt, rank, range(4))
    state.flush()
    out = state.method, [p.detach().clone() for p in net.parameters()]
    state.close()
    return out


def test_auto_with_local_steps_probes_every_step_exchanges_and_trains(spawn):
    (m0, w0), (m1, w1) = spawn(_register_auto_local, 2, timeout=240)
    assert m0 == m1
    for a, b in zip(w0, w1):  # flush() at a round's end: every rank holds the global point
        torch.testing.assert_close(a, b)


def test_a_local_steps_candidate_counts_its_seconds_per_step(monkeypatch):
    """sparseloco exchanges once per round of local_steps: the probe's seconds per exchange
    count divided by its local_steps (the same seconds per exchange: it wins)."""
    monkeypatch.setattr(auto, "time_exchanges", lambda states, params, group, device: [1.0, 1.0])
    cfgs = {m: gradcomp.build_config(m) for m in ("allreduce", "sparseloco")}
    named = [("w", torch.nn.Parameter(torch.zeros(64, 64)))]
    found = auto.probe(lambda n, c: None, cfgs, named, None, None)
    H = cfgs["sparseloco"][1].local_steps
    assert H > 1 and found["seconds"] == {"allreduce": 1.0, "sparseloco": 1.0 / H}
    assert found["chosen"] == "sparseloco"
    assert optimizer_binding.default_exchange("sparseloco") == "local"
    assert optimizer_binding.default_exchange("onebit") == "momentum"


def test_with_a_scaler_no_local_steps_candidate(monkeypatch):
    """A GradScaler is refused with local steps: auto leaves such methods out with one."""
    from gradcomp.compressors import METHODS
    monkeypatch.setattr(METHODS["sparseloco"].compressor, "measured",
                        {"adamw_gap_pct": {"local": 0.5}})
    adamw = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    assert "sparseloco" in auto.candidates(adamw)
    assert "sparseloco" not in auto.candidates(adamw, scaler=object())
    assert set(auto.configs({}, adamw, object())) == set(auto.candidates(adamw, object()))
