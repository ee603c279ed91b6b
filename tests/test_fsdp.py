"""FSDP2 (fully_shard) and HSDP: gradcomp.register on a sharded model (hooks/fsdp.py). Gloo,
CPU: 2 ranks FSDP (a 1-D mesh), 4 ranks HSDP (2 replicas x 2 shards). Rows of odd sizes make
FSDP pad some ranks' chunks."""
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradcomp

pytestmark = pytest.mark.filterwarnings("ignore")
EF_METHODS = ["onebit", "topk", "threshold", "terngrad:error_feedback=true"]


class _Shift(nn.Module):
    """A one-row parameter (under HSDP 2 x 2 shard 1 holds none of it: an empty piece, in
    the unit FSDP reduces first) beside a frozen one (FSDP leaves it out of its reduction)."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.zeros(1, 10))
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x):
        return x + self.b * self.frozen.sum()


def _net(world, hsdp, mp=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 63), nn.ReLU(), nn.Linear(63, 47), nn.Tanh(),
                        nn.Linear(47, 10), _Shift())
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if hsdp else init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    kw = {"mesh": mesh}
    if mp:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for m in (*net[::2], net[5]):
        fully_shard(m, **kw)
    return fully_shard(net, **kw)


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 20, generator=g), torch.randint(0, 10, (8,), generator=g)


def _backward(net, rank, step, micro=1):
    for k in range(micro):
        if micro > 1:
            net.set_requires_gradient_sync(k == micro - 1)
        x, y = _batch(rank, step * micro + k)
        nn.functional.cross_entropy(net(x).float(), y).backward()


def _train(net, opt, rank, steps, micro=1):
    for step in steps:
        opt.zero_grad()
        _backward(net, rank, step, micro)
        opt.step()


def _local(net):
    return [p.detach().to_local().clone() for p in net.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _replicas_agree(net, state):
    """HSDP: every replica of this shard holds the same values (bit for bit)."""
    group = state._state.group
    for t in _local(net):
        got = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(got, t, group=group)
        if not all(torch.equal(g, t) for g in got):
            return False
    return True


def _sgd(net):
    return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)


def _equal_to_plain(rank, world, hsdp):
    """``allreduce`` is plain FSDP/HSDP bit for bit: fp32, bf16 mixed precision, and
    gradient accumulation with set_requires_gradient_sync(False). Plain allreduce on
    purpose: the adapter's own plumbing, nothing compressed."""
    out = {}
    for mp, micro in ((False, 1), (True, 1), (False, 2)):
        plain = _net(world, hsdp, mp)
        opt = _sgd(plain)
        _train(plain, opt, rank, range(4), micro)
        net = _net(world, hsdp, mp)
        opt = _sgd(net)
        state = gradcomp.register(net, "allreduce", optimizer=opt)
        _train(net, opt, rank, range(4), micro)
        out[(mp, micro)] = (_same(_local(plain), _local(net)), state.step)
        state.close()
    return out


def _conserves(rank, world, hsdp):
    """One compressed step from zero memory: the gradient FSDP hands the optimizer plus the
    ranks' average residual (this rank's rows of it) is the dense gradient."""
    plain = _net(world, hsdp)
    _backward(plain, rank, 0)
    want = [p.grad.to_local() for p in plain.parameters() if p.requires_grad]
    me = plain[0].weight.device_mesh.get_local_rank("shard")
    W = plain[0].weight.device_mesh.size(-1)
    names = [n for n, p in plain.named_parameters() if p.requires_grad]
    out = {}
    for spec in EF_METHODS:
        net = _net(world, hsdp)
        state = gradcomp.register(net, spec, warmup="none", min_numel=0)
        _backward(net, rank, 0)
        mem = state.state_dict()["memory"]["flat"]
        group = dist.get_world_size(state._state.group)
        # what memory holds back: the residual, and onebit's second (owner's) memory, which
        # holds W ranks' worth of its part
        weights = {"residual": 1.0, "accumulation": 1.0, "server_residual": float(group)}
        worst = 0.0
        trained = [p for p in net.parameters() if p.requires_grad]
        for name, p, g in zip(names, trained, want):
            key = f"{name}#{me}/{W}" if hsdp else name
            if not any(key in mem.get(slot, {}) for slot in weights):  # no rows of it here
                assert g.numel() == 0, (spec, name)
                continue
            res = sum(w * mem[slot][key] for slot, w in weights.items() if key in mem.get(slot, {}))
            dist.all_reduce(res, group=state._state.group)
            res /= group
            if not hsdp:  # the whole parameter's residual: this rank's chunk of rows
                rows = torch.chunk(res.view(p.shape), W)
                res = rows[me] if me < len(rows) else res[:0]
            if g.numel():
                worst = max(worst, (p.grad.to_local() + res.view(g.shape) - g).abs().max().item())
        stats = state.stats()
        out[spec] = (worst, stats["wire_bytes"] < stats["raw_wire_bytes"]
                     and stats["compressing_since"] == 0)
        state.close()
    return out


def _resume(rank, world, hsdp, spec, where=None, adamw=False):
    """Stop after 3 steps, reload model, optimizer and gradcomp state into fresh objects, go
    on: bit for bit the uninterrupted run; HSDP replicas agree; both runs compressed (from
    the first step, or the third with ``adamw``). ``where``: a directory for
    torch.distributed.checkpoint (model and optimizer through its get/set_state_dict, the
    state as ``state.stateful()``); None: torch.save of each (weights_only). ``adamw``:
    AdamW with two dense steps (v frozen at step 2; the frozen step travels in gradcomp's
    state, as DCP carries no extra keys of the optimizer's)."""
    import copy
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh():
        net = _net(world, hsdp)
        if adamw:
            opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
            return net, opt, gradcomp.register(net, spec, optimizer=opt, dense_steps=2,
                                               min_numel=0)
        opt = _sgd(net)
        return net, opt, gradcomp.register(net, spec, optimizer=opt, warmup="none",
                                           min_numel=0)
    net, opt, state = fresh()
    _train(net, opt, rank, range(3))
    if where:
        msd, osd = get_state_dict(net, opt)
        dcp.save({"model": msd, "optim": osd, "gradcomp": state.stateful()}, checkpoint_id=where)
    else:
        buf = io.BytesIO()
        torch.save(state.state_dict(), buf)
        saved_model = {k: v.clone() for k, v in net.state_dict().items()}
        saved_opt = copy.deepcopy(opt.state_dict())
    _train(net, opt, rank, range(3, 6))
    whole = _local(net)
    agree = _replicas_agree(net, state) if hsdp else True
    moved = not _same(whole, _local(_net(world, hsdp)))
    since = state.stats()["compressing_since"]
    state.close()
    net2, opt2, state2 = fresh()
    _train(net2, opt2, rank, range(7, 8))  # a state that ran a step: load replaces it all
    if where:
        msd, osd = get_state_dict(net2, opt2)
        sd = {"model": msd, "optim": osd, "gradcomp": state2.stateful()}
        dcp.load(sd, checkpoint_id=where)
        set_state_dict(net2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        net2.load_state_dict(saved_model)
        opt2.load_state_dict(saved_opt)
        buf.seek(0)
        state2.load_state_dict(torch.load(buf, weights_only=True))
    _train(net2, opt2, rank, range(3, 6))
    exact = _same(whole, _local(net2))
    stats = state2.stats()
    state2.close()
    compressed = (since == stats["compressing_since"] == (2 if adamw else 0)
                  and stats["run_ratio"] > 1.5)  # the resumed steps 3-5: all compressed
    return exact, agree, moved, compressed


def _adamw(rank, world, hsdp):
    """AdamW at the recommended default (terngrad) with a short dense phase: Adam's variance
    freezes at the switch for the compressed (sharded) parameters; replicas agree."""
    net = _net(world, hsdp)
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in net.named_parameters() if not n.endswith("weight") and p.requires_grad]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95))
    state = gradcomp.register(net, "terngrad", optimizer=opt, dense_steps=2, min_numel=0)
    _train(net, opt, rank, range(5))
    frozen = sorted({state._state.adam.frozen_step(p) for p in decay})
    finite = all(torch.isfinite(t).all() for t in _local(net))
    agree = _replicas_agree(net, state) if hsdp else True
    stats = state.stats()
    state.close()
    return frozen, finite, agree, stats["compressing"]


def _refusals(rank, world, hsdp):
    out = []
    for spec, kw in (("onebit:delay=1", {}), ("onebit:local_steps=2", {}),
                     ("onebit:topology=hierarchical", {}), ("onebit:adam=precondition", {}),
                     ("onebit:adam=momentum", {}), ("dgc", {"wd": 1e-4}), ("onebit", {"scaler": True}),
                     ("onebit", {"differ": True}), ("threshold", {"lanes": 2})):
        net = _net(world, hsdp)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9,
                              weight_decay=kw.get("wd", 0.0))
        if "adam=" in spec:
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        extra = {}
        if kw.get("scaler"):
            extra["scaler"] = torch.amp.GradScaler("cpu")
        if kw.get("differ"):
            extra["ratio"] = 0.01 if rank == 0 else 0.02
            spec = "topk"
        if kw.get("lanes"):
            extra["lanes"] = 2  # no effect under FSDP: refused, not ignored
        try:
            gradcomp.register(net, spec, optimizer=opt, **extra)
            out.append((spec, None))
        except ValueError as exc:
            out.append((spec, str(exc)))
    # adam='auto' with AdamW under FSDP: the second moment frozen, the gradient exchanged (a
    # rank holds only its shard of the first moment)
    net = _net(world, hsdp)
    state = gradcomp.register(net, "onebit", optimizer=torch.optim.AdamW(net.parameters()))
    out.append(("auto", state._state.adam_mode))
    state.close()
    return out


def _record(rank):
    """Wrap torch.distributed's collectives (FSDP's too): a random 0-3 ms delay, then record
    (group, op, numel) and issue."""
    import random
    import time
    log, rng = [], random.Random(99 + 13 * rank)

    def wrap(name, fn):
        def wrapped(*args, **kw):
            time.sleep(rng.uniform(0, 0.003))
            t = next(v for v in (*args, *kw.values()) if torch.is_tensor(v)
                     or isinstance(v, list))
            n = sum(x.numel() for x in t) if isinstance(t, list) else t.numel()
            g = kw.get("group")
            if g is None or dist.get_world_size(g) > 1:  # (HSDP's no-op: a group of one)
                log.append((getattr(g, "group_name", str(g)), name, n))
            return fn(*args, **kw)
        return wrapped
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single",
                 "reduce_scatter_tensor"):
        setattr(dist, name, wrap(name, getattr(dist, name)))
    return log


def _order(rank, world, hsdp):
    """onebit: the adaptive warm-up's windows (their allreduce) and its switch at step 2;
    powersgd and dgc compressed from the first step."""
    log, since = _record(rank), []
    for spec in ("onebit:warmup_window=1,warmup_threshold=100", "powersgd:warmup=none",
                 "dgc:ratio=0.05,warmup=none"):
        net = _net(world, hsdp)
        opt = _sgd(net)
        state = gradcomp.register(net, spec, optimizer=opt, min_numel=0)
        _train(net, opt, rank, range(4))
        since.append(state.stats()["compressing_since"])
        state.close()
    return log, since


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp2", "hsdp2x2"])
def test_every_group_sees_one_order_under_jitter(spawn, hsdp):
    """Random delays before every collective, different per rank: on every process group,
    every member issues the same sequence of (op, size), FSDP's own collectives included."""
    world = 4 if hsdp else 2
    logs, since = zip(*spawn(_order, world, args=(hsdp,), timeout=300))
    assert all(s == [2, 0, 0] for s in since), since
    groups = {g for log in logs for g, _, _ in log}
    assert len(groups) >= (3 if hsdp else 1)
    for g in groups:
        seqs = [[(op, n) for gg, op, n in log if gg == g] for log in logs]
        members = [q for q in seqs if q]
        assert len(members) >= 2 and all(q == members[0] for q in members), g


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp2", "hsdp2x2"])
def test_allreduce_is_plain_fsdp_bit_for_bit(spawn, hsdp):
    world = 4 if hsdp else 2
    for r in spawn(_equal_to_plain, world, args=(hsdp,), timeout=240):
        assert r == {(False, 1): (True, 4), (True, 1): (True, 4), (False, 2): (True, 4)}, r


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp2", "hsdp2x2"])
def test_error_feedback_conserves_every_gradient(spawn, hsdp):
    world = 4 if hsdp else 2
    for r in spawn(_conserves, world, args=(hsdp,), timeout=240):
        for spec, (worst, fewer) in r.items():
            assert worst < 1e-5, (spec, worst)
            assert fewer, spec  # and it was compressed


@pytest.mark.parametrize("hsdp,spec,dcp,adamw", [
    (False, "onebit", False, False), (False, "powersgd", True, False),
    (True, "topk", True, False), (True, "dgc", False, False), (False, "terngrad", True, True)],
    ids=["fsdp2-onebit", "fsdp2-powersgd-dcp", "hsdp2x2-topk-dcp", "hsdp2x2-dgc",
         "fsdp2-terngrad-adamw-dcp"])
def test_resume_is_bit_exact(spawn, tmp_path, hsdp, spec, dcp, adamw):
    world = 4 if hsdp else 2
    where = str(tmp_path / "ckpt") if dcp else None
    for exact, agree, moved, compressed in spawn(_resume, world,
                                                 args=(hsdp, spec, where, adamw), timeout=240):
        assert moved and exact and agree and compressed, (exact, agree, moved, compressed)


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp2", "hsdp2x2"])
def test_adamw_freezes_the_variance_of_sharded_parameters(spawn, hsdp):
    world = 4 if hsdp else 2
    for frozen, finite, agree, compressing in spawn(_adamw, world, args=(hsdp,), timeout=240):
        assert frozen == [2] and finite and agree and compressing


def test_unsupported_settings_are_refused_on_every_rank(spawn):
    results = spawn(_refusals, 2, args=(False,), timeout=240)
    want = {"onebit:delay=1": "delay=1", "onebit:local_steps=2": "local_steps=2",
            "onebit:topology=hierarchical": "HSDP", "onebit:adam=precondition": "precondition",
            "onebit:adam=momentum": "only its shard", "dgc": "weight decay", "onebit": "scaler",
            "topk": "ratio", "threshold": "lanes=2 with an FSDP model", "auto": "freeze"}
    for r in results:
        assert [s for s, _ in r] == list(want)
        for spec, msg in r:
            assert msg is not None and want[spec] in msg, (spec, msg)


def _lifecycle(rank, world):
    """What a fine-tuning job does to a registered model: register twice (refused), unfreeze
    a layer (named at the next forward, before FSDP starts its step; close and register
    again, and training goes on; a whole unit frozen is not a change of layout), and close a
    state of a grouped fully_shard([a, b]) (FSDP's own reduce-scatter is back). onebit
    compresses every parameter from the first step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    out = {}
    net = _net(world, False)
    opt = _sgd(net)
    state = gradcomp.register(net, "onebit", optimizer=opt, warmup="none", min_numel=0)
    _train(net, opt, rank, range(1))
    try:
        gradcomp.register(net, "topk", optimizer=opt)
        out["twice"] = None
    except ValueError as exc:
        out["twice"] = str(exc)
    net[5].frozen.requires_grad_(True)
    try:
        _train(net, opt, rank, range(1, 2))
        out["unfrozen"] = None
    except RuntimeError as exc:
        out["unfrozen"] = str(exc)
    state.close()
    opt = _sgd(net)
    state = gradcomp.register(net, "onebit", optimizer=opt, warmup="none", min_numel=0)
    before = _local(net)
    _train(net, opt, rank, range(2, 4))
    out["goes_on"] = (state.step, not _same(before, _local(net)))
    net[0].requires_grad_(False)  # a whole unit frozen: FSDP reduces nothing of it
    _train(net, opt, rank, range(4, 5))
    out["unit_frozen"] = state.step
    stats = state.stats()
    out["compressed"] = stats["compressing_since"] == 0 and stats["run_ratio"] > 1.5
    state.close()
    # grouped: two modules, one FSDP state and parameter group
    torch.manual_seed(0)
    grouped = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 10))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    fully_shard([grouped[0], grouped[2]], mesh=mesh)
    fully_shard(grouped, mesh=mesh)
    g = grouped[0]._get_fsdp_state()._fsdp_param_groups[0]
    was = (g._reduce_scatter_comm, g.reduce_scatter_unused_params)
    gradcomp.register(grouped, "topk").close()
    out["grouped"] = (g._reduce_scatter_comm, g.reduce_scatter_unused_params) == was
    return out


def test_register_twice_unfreeze_and_close_a_grouped_model(spawn):
    for out in spawn(_lifecycle, 2, timeout=240):
        assert "registered already" in out["twice"]
        assert "'5.frozen' was unfrozen" in out["unfrozen"]
        assert out["goes_on"] == (2, True) and out["unit_frozen"] == 3
        assert out["compressed"]
        assert out["grouped"]


def _overlap(rank, world, hsdp, overlapped, units=(0, 2, 4)):
    """Steps with the first exchange of each backward (the last unit's) held until the next
    unit's backward has begun, up to 5 s: whether it began while that exchange ran, and
    the parameters after the steps. ``overlapped`` False: the adapter's synchronous path."""
    import threading
    from gradcomp.hooks import fsdp as adapter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if not overlapped:
        adapter._overlaps = lambda group, out: False
    torch.manual_seed(0)
    # rows of every parameter on every shard (a shard without any would run its step's flag
    # on its own thread, waiting for the held exchange)
    net = nn.Sequential(nn.Linear(20, 63), nn.ReLU(), nn.Linear(63, 47), nn.Tanh(),
                        nn.Linear(47, 10))
    mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            if hsdp else init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    for i in units:  # the rest is the root's (reduced in FSDP's final callback)
        fully_shard(net[i], mesh=mesh)
    net = fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    state = gradcomp.register(net, "onebit", optimizer=opt, warmup="none", min_numel=0)
    began = threading.Event()
    net[2].register_full_backward_pre_hook(lambda *_: began.set())
    orig, seen = state._state.compressor.reduce, []

    def held(x, ctx):
        if ctx.bucket == 0:  # the last unit's exchange, the backward's first
            seen.append(began.wait(5))
        return orig(x, ctx)
    state._state.compressor.reduce = held
    for step in range(3):
        began.clear()
        opt.zero_grad()
        _backward(net, rank, step)
        opt.step()
    stats = state.stats()
    state.close()
    return seen, _local(net), stats["compressing_since"], stats["run_ratio"]


@pytest.mark.parametrize("kind,world", [("fsdp2", 2), ("hsdp2x2", 4)])
def test_the_next_units_backward_runs_while_an_exchange_is_in_flight(kind, world, spawn):
    """The exchanges run on the state's lane beside backward, their results put into FSDP's
    gradients when backward ends: the next unit's backward starts while the last unit's
    compressed exchange is still running (it waits for that start), and training ends
    bit-identical to the synchronous path's."""
    hsdp = kind.startswith("hsdp")
    on = spawn(_overlap, world, args=(hsdp, True))
    off = spawn(_overlap, world, args=(hsdp, False))
    for (seen, params, since, ratio), (seen0, params0, _, _) in zip(on, off):
        assert since == 0 and ratio > 1.5  # compressed from the first step
        assert seen == [True] * 3  # in flight while the next unit's backward began
        assert seen0 == [False] * 3  # synchronously: the wait ran out
        assert _same(params, params0)


def test_an_exchange_issued_at_the_end_of_backward_is_put_in_too(spawn):
    """The root's own parameters are reduced from FSDP's final autograd callback: their
    exchange, issued there, is still waited for and put into the gradients (bit-identical to
    the exchange run at once)."""
    on = spawn(_overlap, 2, args=(False, True, (0,)))
    off = spawn(_overlap, 2, args=(False, False, (0,)))
    for (_, params, since, _), (_, params0, _, _) in zip(on, off):
        assert since == 0 and _same(params, params0)
