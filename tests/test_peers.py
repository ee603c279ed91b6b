"""The peer in the harness: torchft's own DiLoCo on the harness's GPT job (gradcomp_bench/peers.py)."""
import pytest
import torch
import torch.nn.functional as F

from gradcomp_bench import peers
from gradcomp_bench.train import parse_method


def _params(net):
    return [p.detach().clone() for p in net.parameters()]


def _inner_loop(rank, world, spec, steps):
    """``steps`` AdamW steps of a tiny GPT on this rank's own batches under the peer: each
    step's parameters just before the peer's sync and just after it, the fragments' parameter
    ids, and the peer's stats after each step."""
    from gradcomp_bench import models
    torch.manual_seed(0)
    net = models.build("gpt_tiny")
    opt = torch.optim.AdamW(models.decay_groups(net, 0.1), lr=3e-3, betas=(0.9, 0.95))
    before = []
    opt.register_step_post_hook(lambda *_: before.append(_params(net)))  # runs before the sync
    start = _params(net)
    state = peers.attach(net, spec, opt, rank, world)
    ids = {id(p): i for i, p in enumerate(net.parameters())}
    frags = [[ids[id(p)] for p in f.parameters()] for f in state.fragments]
    gen = torch.Generator().manual_seed(100 + rank)
    after, stats = [], []
    for _ in range(steps):
        x = torch.randint(0, 128, (4, 16), generator=gen)
        loss = F.cross_entropy(net(x).flatten(0, 1), x.roll(-1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        after.append(_params(net))
        stats.append(state.stats())
    state.close()
    return {"start": start, "before": before, "after": after, "frags": frags, "stats": stats}


def _job(rank, world):
    """Two peers' inner loops, then the harness's own GPT job (train_lm) under the peer."""
    from gradcomp_bench.train import TrainConfig, train
    one = _inner_loop(rank, world, "torchft-diloco:sync_every=2,outer_lr=0.5,outer_momentum=0.8", 4)
    two = _inner_loop(rank, world, "torchft-diloco:sync_every=4,fragments=2", 6)
    cfg = TrainConfig(method="torchft-diloco:sync_every=2", model="gpt_tiny", synthetic=True,
                      max_steps=5, batch=4, lr=1e-3, weight_decay=0.1, seq_len=16, eval_every=5)
    res = train(rank, world, cfg)
    return one, two, {k: res[k] for k in ("stats", "stats_history", "val_loss", "curve")}


def _same(a, b, idx):
    return all(torch.equal(a[i], b[i]) for i in idx)


@pytest.fixture(scope="module")
def ranks(spawn):
    pytest.importorskip("torchft", reason="the peer needs torchft (pip install gradcomp[peers])")
    return spawn(_job, 2, timeout=240)


def test_the_outer_step_is_torchs_nesterov_sgd_on_the_averaged_pseudo_gradient(ranks):
    (r0, _, _), (r1, _, _) = ranks
    everything = range(len(r0["start"]))
    # mid-round the replicas have stepped on their own batches
    assert not _same(r0["after"][0], r1["after"][0], everything)
    assert not _same(r0["after"][2], r1["after"][2], everything)
    # after each sync (steps 2 and 4) they hold the same parameters
    assert _same(r0["after"][1], r1["after"][1], everything)
    assert _same(r0["after"][3], r1["after"][3], everything)
    # the first sync: from the round's start, delta = mean of (start - local); Nesterov SGD's
    # first step from a zero buffer moves by lr * (1 + momentum) * delta (a plain average
    # would move by delta: lr * (1 + m) = 0.9 here)
    lr, m = 0.5, 0.8
    for i in everything:
        start = r0["start"][i].double()
        delta = (2 * start - r0["before"][1][i].double() - r1["before"][1][i].double()) / 2
        want = start - lr * (1 + m) * delta
        torch.testing.assert_close(r0["after"][1][i].double(), want, rtol=0, atol=1e-6)
        average = (r0["before"][1][i] + r1["before"][1][i]) / 2
        if delta.abs().max() > 1e-4:
            assert not torch.allclose(r0["after"][1][i], average, atol=1e-6)


def test_fragments_sync_at_their_own_steps(ranks):
    (_, r0, _), (_, r1, _) = ranks
    f0, f1 = r0["frags"]
    assert sorted(f0 + f1) == list(range(len(r0["start"]))) and f0 and f1
    # sync_every=4 with 2 fragments: fragment 0 at steps 2 and 6, fragment 1 at step 4
    for step, synced, local in ((2, f0, f1), (4, f1, f0), (6, f0, f1)):
        a, b = r0["after"][step - 1], r1["after"][step - 1]
        assert _same(a, b, synced), step
        assert not _same(a, b, local), step
    assert not _same(r0["after"][0], r1["after"][0], f0 + f1)


def test_bytes_are_an_fp32_ring_allreduce_of_each_synced_fragment(ranks):
    (one, two, lm), _ = ranks
    n = [p.numel() for p in one["start"]]
    ring = 2 * (2 - 1) / 2  # 2 ranks
    total = sum(n)
    assert [s["wire_bytes"] for s in one["stats"]] == [0, ring * 4 * total] * 2
    assert one["stats"][-1]["run_wire_bytes"] == 2 * ring * 4 * total
    assert one["stats"][-1]["syncs"] == 2 and one["stats"][-1]["manager_step"] == 2
    assert one["stats"][-1]["run_ratio"] == 2  # 4 steps' allreduces against 2 syncs
    f0, f1 = (sum(n[i] for i in f) for f in two["frags"])
    assert [s["wire_bytes"] for s in two["stats"]] == [0, ring * 4 * f0, 0, ring * 4 * f1, 0,
                                                       ring * 4 * f0]
    # the harness's job: 5 steps with sync_every=2 sync twice; its rows count the same bytes
    from gradcomp_bench.cli import _run_MB
    from gradcomp_bench.models import build
    gpt = sum(p.numel() for p in build("gpt_tiny").parameters())
    assert lm["stats"]["run_wire_bytes"] == 2 * ring * 4 * gpt
    assert len(lm["stats_history"]) == 5
    assert _run_MB("torchft-diloco:sync_every=2", lm, "gpt_tiny") == 2 * ring * 4 * gpt / 1e6
    assert lm["val_loss"] == lm["curve"][-1]["val_loss"] > 0


@pytest.mark.parametrize("spec, words", [
    ("torchft-diloco:sync_every=0", ["sync_every=0", "integer >= 1"]),
    ("torchft-diloco:sync_every=16,fragments=3", ["fragments=3", "divisor of sync_every=16"]),
    ("torchft-diloco:fragments=0", ["fragments=0", "divisor"]),
    ("torchft-diloco:outer_lr=0", ["outer_lr=0", "> 0"]),
    ("torchft-diloco:outer_momentum=1", ["outer_momentum=1", "0 <= m < 1"]),
    ("torchft-diloco:sync_every=8,fragments=2,fragment_sync_delay=4",
     ["fragment_sync_delay=4", "0 to 3"]),
    ("torchft-diloco:fragment_update_alpha=2", ["fragment_update_alpha=2", "0 to 1"]),
    ("torchft-diloco:rounds=3", ["'rounds=3'", "allowed sync_every=16", "fragments=1",
                                 "outer_lr=0.7", "outer_momentum=0.9"]),
    ("torchft-diloco:sync_every=x", ["'sync_every=x'", "an integer"]),
    ("torchft-diloco|ordered", ["|ordered", "gradcomp's methods"]),
])
def test_bad_options_are_refused_naming_the_value_and_what_is_allowed(spec, words):
    with pytest.raises(ValueError) as exc:
        parse_method(spec)
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))


def test_defaults_are_torchtitans_and_the_cli_refuses_bad_specs_before_running():
    from gradcomp_bench.cli import UsageError, _methods
    assert parse_method("torchft-diloco") == ("torchft-diloco", {
        "sync_every": 16, "fragments": 1, "outer_lr": 0.7, "outer_momentum": 0.9,
        "fragment_sync_delay": 0, "fragment_update_alpha": 0.0})
    with pytest.raises(UsageError, match="fragments=5"):
        _methods("allreduce,torchft-diloco:sync_every=16,fragments=5")


def test_fragments_split_a_gpt_by_layers_and_refuse_more_than_its_modules():
    from gradcomp_bench import models
    net = models.build("gpt")
    four = peers.fragments(net, 4)
    # embeddings with the first block, one block each, the last block with the norm and head
    assert [len(f) for f in four] == [3, 1, 1, 3]
    assert four[0][0] is net.tok and four[-1][-1] is net.head
    assert sum(p.numel() for f in four for p in f.parameters()) == sum(p.numel() for p in net.parameters())
    with pytest.raises(ValueError, match="fragments=9: GPT has 8 modules to split; allowed 1 to 8"):
        peers.fragments(net, 9)


@pytest.mark.parametrize("argv", [["--model", "resnet_small"],
                                  ["--model", "gpt", "--parallel", "fsdp"]])
def test_convergence_refuses_a_peer_off_the_language_models_ddp_job(argv, tmp_path, capsys):
    from gradcomp_bench.cli import main
    assert main(["convergence", "--methods", "torchft-diloco:sync_every=4", "--out",
                 str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert "torchft-diloco:sync_every=4: peers run on language models" in err
    assert "--parallel ddp" in err


def test_without_torchft_the_peer_says_what_to_install(monkeypatch, tmp_path, capsys):
    import importlib.util
    from gradcomp_bench.cli import main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else real(name, *a))
    assert peers.missing("torchft-diloco:sync_every=4") == (
        "torchft-diloco needs torchft 0.2.0: pip install 'gradcomp[peers]'")
    assert main(["convergence", "--model", "gpt", "--methods", "torchft-diloco", "--out",
                 str(tmp_path)]) == 2
    assert "needs torchft 0.2.0: pip install 'gradcomp[peers]'" in capsys.readouterr().err
    with pytest.raises(ImportError, match=r"gradcomp\[peers\]"):
        peers.attach(None, "torchft-diloco", None, 0, 2)
