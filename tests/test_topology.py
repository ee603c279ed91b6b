"""Hierarchical topology: dense inside a node, compressed between nodes. Four gloo ranks
stand for 2 nodes x 2 ranks (``local_size=2``); one spawn serves the module. Every run
compresses from its first step (``warmup=none``) over several DDP buckets."""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.config import MethodConfig
from gradcomp.hooks.topology import Shards, node_size
from conftest import lay_out, record_collectives, small_net, train_capturing

HIER = "topology=hierarchical,local_size=2"
CONSERVE = ["topk:ratio=0.05", "onebit:chunk=64", "powersgd:rank=1", "dgc:ratio=0.02",
            "terngrad:error_feedback=true", "topk:ratio=0.05|odd", "onebit:chunk=64|odd",
            "powersgd:rank=1|odd"]
# allreduce: the plain exchange's order, on purpose (nothing compressed); the others compress
ORDER = ["topk:ratio=0.05", "onebit:chunk=64", "powersgd:rank=1", "allreduce"]
STEPS = 5


def _with(spec, extra):
    return f"{spec},{extra}" if ":" in spec else f"{spec}:{extra}"


class _Odd(nn.Module):
    """Odd row counts (63, 7: shards of unequal length) and a 1-row parameter (its second
    piece is empty)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(20, 63), nn.Linear(63, 7), nn.Linear(7, 10)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 7).reshape(1, 7))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))) * self.gate)


def odd_net():
    torch.manual_seed(0)
    return _Odd()


NETS = {"small": small_net, "odd": odd_net}


def _train(rank, spec, steps=STEPS, capture=False, sgd=None, net_fn=small_net, ordered=None):
    net = net_fn()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), **(sgd or {"lr": 0.05}))
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, warmup="none") if spec else None
    if ordered is not None:  # NCCL's global order, which gloo's default skips
        state.ordered = ordered
    local, avg = train_capturing(rank, model, net, opt, steps, capture)
    params = [p.detach().clone() for p in net.parameters()]
    return state, params, local, avg


def _since(state):
    return state.stats()["compressing_since"]


def _job(rank, world):
    out = {"conserve": {}, "equal": {}, "since": {}}
    for key in CONSERVE:
        spec, _, net = key.partition("|")
        state, _, local, avg = _train(rank, _with(spec, HIER), capture=True,
                                      net_fn=NETS[net or "small"])
        mem = state.state_dict()["memory"]["flat"]
        out["conserve"][key] = (local, avg, {s: {n: v.clone() for n, v in d.items()}
                                              for s, d in mem.items()})
        out["since"][key] = _since(state)
    ref = _train(rank, None, sgd={"lr": 0.1, "momentum": 0.9})[1]
    for spec in ("allreduce", "topk:ratio=1", "dgc:ratio=1,masking=false"):
        state, params = _train(rank, _with(spec, HIER), sgd={"lr": 0.1, "momentum": 0.9})[:2]
        out["equal"][spec] = (ref, params)
        out["since"][spec] = _since(state)
    flat, hier = (_train(rank, _with("topk:ratio=0.05", t))[0] for t in ("topology=flat", HIER))
    out["stats"] = (flat.stats(), hier.stats())
    sd = hier.state_dict()
    try:
        flat.load_state_dict(sd)
    except ValueError as exc:
        out["refused"] = str(exc)
    try:
        gradcomp.register(DDP(small_net()), "topk:topology=hierarchical,local_size=3")
    except ValueError as exc:
        out["bad"] = str(exc)
    log = record_collectives(rank)
    out["order"] = {}
    for spec in ORDER:
        for d in (0, 1):
            start = len(log)
            state = _train(rank, _with(spec, f"{HIER},delay={d}"), steps=3, ordered=True)[0]
            state._state.drain()
            out["order"][(spec, d)] = log[start:]
            out["since"][(spec, d)] = _since(state)
        start = len(log)  # gloo's default: no global order, each group's own order
        state = _train(rank, _with(spec, f"{HIER},delay=1"), steps=3)[0]
        state._state.drain()
        out["order"][(spec, "gloo")] = log[start:], state.ordered
        out["since"][(spec, "gloo")] = _since(state)
    return out


@pytest.fixture(scope="module")
def runs(spawn):
    return spawn(_job, 4, timeout=900)


@pytest.mark.parametrize("spec", CONSERVE)
def test_error_feedback_conserves_every_gradient_per_shard(runs, spec):
    """sum_t average_t == (1/W) sum over ranks of sum_t local gradient - (1/N) sum over nodes
    of the node's residual (each local rank keeps its shard's pieces of it)."""
    W, L = 4, 2
    N = W // L
    weights = {"residual": 1.0, "accumulation": 1.0, "server_residual": float(N)}
    local0, avg0, _ = runs[0]["conserve"][spec]
    assert all(r["since"][spec] == 0 for r in runs)
    net = NETS[spec.partition("|")[2] or "small"]()
    for n in local0:
        assert all(torch.allclose(r["conserve"][spec][1][n], avg0[n]) for r in runs)
        total = sum(r["conserve"][spec][0][n] for r in runs) / W
        left = torch.zeros_like(total)
        for r in runs:
            for slot, w in weights.items():
                for name, v in r["conserve"][spec][2].get(slot, {}).items():
                    base, _, piece = name.partition("#")
                    if base != n:
                        continue
                    j, size = map(int, piece.split("/"))
                    rows = net.get_parameter(n).shape[0] if net.get_parameter(n).dim() >= 2 \
                        else total.numel()
                    per_row = total.numel() // rows
                    a = (j * rows // size) * per_row
                    left[a : a + v.numel()] += w * v.double() / N
        torch.testing.assert_close(avg0[n], total - left, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("spec", ["allreduce", "topk:ratio=1", "dgc:ratio=1,masking=false"])
def test_degenerate_settings_equal_plain_ddp(runs, spec):
    """The compressed path's degenerate settings (``allreduce``: no compression, on purpose)."""
    for r in runs:
        assert r["since"][spec] == (None if spec == "allreduce" else 0)
        ref, got = r["equal"][spec]
        for a, b in zip(ref, got):
            torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


def test_stats_split_bytes_inside_and_between_nodes(runs):
    flat, hier = runs[0]["stats"]
    assert flat["compressing_since"] == hier["compressing_since"] == 0
    assert flat["intra_node_wire_bytes"] == 0 and hier["intra_node_wire_bytes"] > 0
    # each node's 2 ranks send half the bucket each between nodes, to 1 peer instead of 3
    assert hier["inter_node_wire_bytes"] < 0.4 * flat["inter_node_wire_bytes"]


def test_a_checkpoint_of_another_topology_is_refused(runs):
    assert runs[0]["stats"][1]["compressing_since"] == 0  # saved in the compressed phase
    assert "hierarchical with 2 ranks per node" in runs[0]["refused"]
    assert "flat" in runs[0]["refused"]


def test_a_node_size_that_does_not_divide_the_world_is_refused_on_every_rank(runs):
    assert all("invalid local_size=3" in r["bad"] and "divisor of the world size 4" in r["bad"]
               for r in runs)


@pytest.mark.parametrize("spec", ORDER)
@pytest.mark.parametrize("delay", [0, 1])
def test_every_rank_issues_the_same_global_sequence(runs, spec, delay):
    seqs = [r["order"][(spec, delay)] for r in runs]
    assert all(r["since"][(spec, delay)] == (None if spec == "allreduce" else 0) for r in runs)
    # ranks of one node share the node group; every rank's sequence of (op, size) and of
    # which of its groups is used must agree with the others'
    def shape(seq):
        names = {}
        return [(names.setdefault(g, len(names)), op, n) for g, op, n in seq]
    assert len({len(s) for s in seqs}) == 1
    for s in seqs[1:]:
        assert shape(s) == shape(seqs[0])


def test_node_size_resolution():
    cfg = MethodConfig
    assert node_size(cfg(), 8, {"LOCAL_WORLD_SIZE": "4"}) == 4        # auto: 2 nodes of 4
    assert node_size(cfg(), 4, {"LOCAL_WORLD_SIZE": "4"}) == 0        # auto: one node
    assert node_size(cfg(), 8, {}) == 0                               # auto: unknown -> flat
    assert node_size(cfg(topology="flat"), 8, {"LOCAL_WORLD_SIZE": "4"}) == 0
    assert node_size(cfg(topology="hierarchical", local_size=2), 8, {}) == 2
    with pytest.raises(ValueError, match="local_size=L, or torchrun's LOCAL_WORLD_SIZE"):
        node_size(cfg(topology="hierarchical"), 8, {})
    with pytest.raises(ValueError, match="invalid local_size=3"):
        node_size(cfg(local_size=3), 8, {})
    with pytest.raises(ValueError, match="invalid topology='ring'"):
        cfg(topology="ring")


def test_shards_cut_each_parameter_alone():
    """A parameter's piece is the same whatever its bucket neighbours; gather/scatter are
    inverse; the pieces tile every parameter."""
    a = lay_out([("w", (5, 3)), ("b", (7,)), ("s", ()), ("e", (0, 4))])
    b = lay_out([("x", (2, 2)), ("w", (5, 3))])
    for L in (1, 2, 3):
        for j in range(L):
            pa = {p.name: (p.shape, r) for p, r in zip(Shards(a, L, j, "cpu").mine,
                                                       Shards(a, L, j, "cpu").ranges)}
            pb = {p.name: (p.shape, r) for p, r in zip(Shards(b, L, j, "cpu").mine,
                                                       Shards(b, L, j, "cpu").ranges)}
            assert pa[f"w#{j}/{L}"] == pb[f"w#{j}/{L}"]
        sh = Shards(a, L, 0, "cpu")
        x = torch.arange(float(sum(p.numel for p in a))) + 1
        torch.testing.assert_close(sh.scatter(sh.gather(x)), x)
        covered = sorted(i for j in range(L) for i in Shards(a, L, j, "cpu").gather(x)[
            j * sh.length : (j + 1) * sh.length].tolist() if i)
        assert covered == x.tolist()


# ------------------------------------------------------------------ topology=auto
AUTO = "topk:ratio=0.05,topology=auto,local_size=2"


def _auto_job(rank, world):
    """topology=auto on 2 nodes x 2 ranks: the real probe, then the probe's times forced
    each way (the decision alone), each against the explicit topology it chose."""
    import gradcomp.hooks.topology as topology
    out = {}
    state, params, _, _ = _train(rank, AUTO)
    out["real"] = (state.stats(), params)
    out["real_ref"] = {t: _train(rank, f"topk:ratio=0.05,topology={t},local_size=2")[1]
                       for t in ("flat", "hierarchical")}
    real = topology.probe_times
    for forced, times in (("flat", (1.0, 2.0)), ("hierarchical", (2.0, 1.0))):
        topology.probe_times = lambda *a, times=times, **k: times
        try:
            state, params, _, _ = _train(rank, AUTO)
        finally:
            topology.probe_times = real
        explicit, explicit_params, _, _ = _train(rank, f"topk:ratio=0.05,topology={forced},local_size=2")
        out[forced] = (state.stats(), params, explicit_params,
                       (_member_groups(state), _member_groups(explicit)))
    return out


def _compressed_between_nodes(stats):
    """What crossed between nodes in the latest step is compressed (under the hierarchical
    topology the steps inside a node stay dense: the whole step's ratio may be below 1)."""
    return stats["inter_node_wire_bytes"] * 1.5 < stats["raw_wire_bytes"]


def _member_groups(state):
    """How many open process groups the state owns that this rank is a member of."""
    import torch.distributed as dist
    return sum(isinstance(g, dist.ProcessGroup) for g in state._state.owned_groups)


@pytest.fixture(scope="module")
def auto_runs(spawn):
    return spawn(_auto_job, 4, timeout=600)


def test_topology_auto_measures_both_and_keeps_the_faster(auto_runs):
    stats = [r["real"][0] for r in auto_runs]
    probe = stats[0]["topology_probe"]
    assert probe["flat_s"] > 0 and probe["hierarchical_s"] > 0 and probe["ranks_per_node"] == 2
    want = "hierarchical" if probe["hierarchical_s"] < probe["flat_s"] else "flat"
    assert probe["chosen"] == want
    assert all(s["topology_probe"] == probe and s["topology"] == want for s in stats)
    assert all(s["compressing_since"] == 0 and _compressed_between_nodes(s) for s in stats)
    for r in auto_runs:  # training under the choice is the explicit topology's, bit for bit
        for a, b in zip(r["real"][1], r["real_ref"][want]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("forced", ["flat", "hierarchical"])
def test_topology_auto_follows_the_measurement(auto_runs, forced):
    for r in auto_runs:
        stats, params, explicit, (groups, explicit_groups) = r[forced]
        assert stats["topology"] == forced and stats["topology_probe"]["chosen"] == forced
        assert stats["compressing_since"] == 0 and _compressed_between_nodes(stats)
        # the probe's node groups are not kept where it chose flat: the groups are the
        # explicit topology's (lanes; with hierarchical, a node and a cross-node group each)
        assert groups == explicit_groups
        for a, b in zip(params, explicit):
            assert torch.equal(a, b)


@pytest.mark.parametrize("spec", ORDER)
def test_on_gloo_each_group_sees_one_sequence_on_all_its_ranks(runs, spec):
    """Without the global order (gloo's default): every process group, the nodes' own and
    the ones across nodes, gets the same sequence of (op, size) from each of its ranks."""
    per_group = {}
    assert all(r["since"][(spec, "gloo")] == (None if spec == "allreduce" else 0) for r in runs)
    for rank, r in enumerate(runs):
        seq, ordered = r["order"][(spec, "gloo")]
        assert ordered is False
        for g, op, n in seq:
            per_group.setdefault(g, {}).setdefault(rank, []).append((op, n))
    shared = [g for g, by_rank in per_group.items() if len(by_rank) > 1]
    assert len(shared) >= 3, "the lanes' flat, node and cross-node groups"
    for g in shared:
        seqs = list(per_group[g].values())
        assert all(q == seqs[0] for q in seqs[1:]), g
