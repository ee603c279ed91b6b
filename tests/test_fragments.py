"""Local steps' fragments (Streaming DiLoCo: ``fragments=N``) and the outer step as a torch
optimizer (``outer_optimizer=``), hooks/local_steps.py. Two gloo ranks on CPU, one spawn for
every 2-rank job of the module; HSDP 2 x 2 in its own spawn."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.hooks.local_steps import fragment_of
from gradcomp_bench.launch import spawn

H = 4
LR = 0.05
STEPS = 3 * H


def _net():
    """Four matrices of equal size: fragments=2 holds two each, fragments=4 one each."""
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(32, 32, bias=False),
                                                         nn.Tanh())))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), None


def _job(spec, sgd=None, **kw):
    net = _net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), **(sgd or {"lr": LR, "momentum": 0.9}))
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0, warmup="none", **kw)
    return net, model, opt, state


def _step(model, opt, rank, step):
    x, _ = batch(rank, step)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x.flip(1)).backward()
    opt.step()


def _params(net):
    return [p.detach().clone() for p in net.parameters()]


def _flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


def _syncs(F, step):
    """The fragments whose round ends after optimizer step ``step`` (1-based)."""
    return [f for f in range(F) if step % H == (f + 1) * H // F % H]


# ---------------------------------------------------------------- the rule, by hand
def _by_hand(rank, world, F):
    """allreduce with outer_lr=1 and no momentum is parameter averaging: each fragment's
    parameters averaged by hand at its own offset, beside the job."""
    net, model, opt, state = _job(f"allreduce:local_steps={H},fragments={F},outer_lr=1,"
                                  f"outer_momentum=0", sgd={"lr": LR})
    ref = _net()
    ropt = torch.optim.SGD(ref.parameters(), lr=LR)
    where = fragment_of([p.numel() for p in ref.parameters()], F)
    got, want = [], []
    for step in range(STEPS):
        _step(model, opt, rank, step)
        _step(ref, ropt, rank, step)
        with torch.no_grad():
            for f in _syncs(F, step + 1):
                for p, g in zip(ref.parameters(), where):
                    if g == f:
                        dist.all_reduce(p)
                        p.div_(world)
        got.append(_flat(net))
        want.append(_flat(ref))
    return got, want, state.step, where


@pytest.mark.parametrize("F", [2, 4])
def test_each_fragment_is_averaged_at_its_own_offset(runs, F):
    for r in runs:
        got, want, exchanges, where = r["by_hand"][F]
        assert sorted(set(where)) == list(range(F))  # every fragment holds parameters
        assert exchanges == STEPS // H * F  # a step of its own per fragment's exchange
        for s, (a, b) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=f"step {s + 1}")


# ---------------------------------------------------------------- agreement and bytes
def _trajectory(rank, world, spec, log):
    """Each step's parameters and the elements its collectives carried (``log``: every
    collective of the process, conftest.record_collectives)."""
    net, model, opt, state = _job(spec)
    params, elements, edges = [], [], []
    for step in range(STEPS):
        start = len(log)
        _step(model, opt, rank, step)
        state._state.drain()
        params.append(_params(net))
        elements.append(sum(n for _, _, n in log[start:] if n > 1))  # (not the guard's flag)
        edges.append(state.stats()["at_round_edge"])
    stats = state.stats()
    stats["edges"] = edges
    state.close()
    return params, elements, stats


AGREE = ["allreduce:local_steps=4,fragments=2", "topk:ratio=0.1,local_steps=4,fragments=2",
         "diloco:local_steps=4,fragments=4,chunk=16"]
PEAK = ["allreduce:local_steps=4", "allreduce:local_steps=4,fragments=2",
        "allreduce:local_steps=4,fragments=4"]


@pytest.mark.parametrize("spec", AGREE)
def test_the_ranks_agree_on_a_fragment_right_after_its_exchange(runs, spec):
    F = int(spec.rpartition("fragments=")[2].split(",")[0])
    (p0, _, stats), (p1, _, _) = (r["agree"][spec] for r in runs)
    where = fragment_of([t.numel() for t in p0[0]], F)
    for s in range(STEPS):
        synced = _syncs(F, s + 1)
        same = [torch.equal(a, b) for a, b in zip(p0[s], p1[s])]
        assert same == [g in synced for g in where], (spec, s + 1, same)
        # stats() says every rank holds the same model only where it does
        assert stats["edges"][s] == all(same), (spec, s + 1)
    if not spec.startswith("allreduce"):  # it compressed
        assert stats["compressing"] and stats["run_ratio"] > 2, (spec, stats["run_ratio"])


def test_fragments_divide_the_peak_bytes_of_one_exchange(runs):
    (e1, e2, e4) = (runs[0]["peak"][s][1] for s in PEAK)
    assert sum(e1) == sum(e2) == sum(e4) == STEPS // H * 4 * 32 * 32  # the same over the run
    whole = max(e1)
    assert max(e2) * 2 == whole and max(e4) * 4 == whole, (max(e1), max(e2), max(e4))
    assert sum(1 for e in e4 if e) == 4 * sum(1 for e in e1 if e)  # spread over the round


# ---------------------------------------------------------------- the outer optimizer
def _outer(rank, world):
    H_spec = f"allreduce:local_steps={H},outer_lr=0.7,outer_momentum=0.9"
    out = {}
    for name, kw in [("default", {}),
                     ("sgd", {"outer_optimizer": lambda p: torch.optim.SGD(
                         p, lr=0.7, momentum=0.9, nesterov=True)}),
                     ("adam", {"outer_optimizer": lambda p: torch.optim.Adam(p, lr=0.01)})]:
        net, model, opt, state = _job(H_spec, **kw)
        for step in range(STEPS):
            _step(model, opt, rank, step)
        out[name] = _flat(net)
        state.close()
    return out


def test_outer_optimizer_takes_a_torch_optimizer_and_the_default_is_sgd_nesterov(runs):
    for r in runs:
        o = r["outer"]
        assert torch.equal(o["default"], o["sgd"])  # the default, bit for bit
        assert not torch.allclose(o["default"], o["adam"], atol=1e-4)  # Adam really stepped
    assert torch.equal(runs[0]["outer"]["adam"], runs[1]["outer"]["adam"])  # at a round's end


# ---------------------------------------------------------------- resume
RESUME = [("topk:ratio=0.1,local_steps=4,fragments=2,local_delay=1", {}),
          ("diloco:local_steps=4,fragments=2,chunk=16", {}),
          ("allreduce:local_steps=4,fragments=2", {
              "outer_optimizer": lambda p: torch.optim.Adam(p, lr=0.01)}),
          # growing rounds (2, 2, 4, 4 steps): at the cut fragment 0's exchange of a 4-step
          # round (sent at 6) and fragment 1's of a 2-step round (sent at 4) are in flight,
          # each applied at its own round's outer lr; 8 exchanges in all
          ("topk:ratio=0.1,local_steps=2,grow_every=4,max_local_steps=4,fragments=2,"
           "local_delay=1", {})]
CUT = 7  # mid-round: fragment 0 synced at 6, fragment 1 at 4 (and 8 to come)
EXCHANGES = {RESUME[-1][0]: 8}  # the others: two a round of H


def _resume(rank, world, path):
    out = []
    for i, (spec, kw) in enumerate(RESUME):
        net, model, opt, state = _job(spec, **kw)
        for step in range(STEPS):
            _step(model, opt, rank, step)
        ref = _flat(net)
        state.close()
        net, model, opt, state = _job(spec, **kw)
        for step in range(CUT):
            _step(model, opt, rank, step)
        ck = {"model": net.state_dict(), "opt": opt.state_dict(), "gradcomp": state.state_dict()}
        torch.save(ck, f"{path}/{i}-{rank}.pt")
        state.close()
        net, model, opt, state = _job(spec, **kw)
        ck = torch.load(f"{path}/{i}-{rank}.pt", weights_only=True)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["gradcomp"])
        for step in range(CUT, STEPS):
            _step(model, opt, rank, step)
        out.append((torch.equal(ref, _flat(net)), state.step))
        state.close()
    return out


def _format2(sd: dict) -> dict:
    """A checkpoint as format 2 wrote it: the outer Nesterov momentum under "momentum" (by
    parameter name), the one exchange in flight under "round"."""
    loc = dict(sd["local"])
    outer, rounds = loc.pop("outer"), loc.pop("rounds")
    loc["momentum"] = outer["state"].get("momentum_buffer") if outer else None
    loc["round"] = rounds.get(0)
    return {**sd, "format": 2, "local": loc}


def _resume_format2(rank, world, path):
    """A format-2 checkpoint (mid-round, local_delay=1: an exchange in flight and the outer
    momentum) resumes bit for bit."""
    from gradcomp.hooks.checkpoint import tensor_digest
    spec = "allreduce:local_steps=4,local_delay=1"
    net, model, opt, state = _job(spec)
    for step in range(STEPS):
        _step(model, opt, rank, step)
    ref = _flat(net)
    state.close()
    net, model, opt, state = _job(spec)
    for step in range(CUT + 2):  # (past the second round's end: momentum and a round in flight)
        _step(model, opt, rank, step)
    sd = _format2(state.state_dict())
    sd.pop("digest", None)
    sd["digest"] = tensor_digest(sd)
    ck = {"model": net.state_dict(), "opt": opt.state_dict(), "gradcomp": sd}
    state.close()
    net, model, opt, state = _job(spec)
    net.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["gradcomp"])
    for step in range(CUT + 2, STEPS):
        _step(model, opt, rank, step)
    out = torch.equal(ref, _flat(net)), sd["local"]["momentum"] is not None, sd["local"]["round"] is not None
    state.close()
    return out


def test_a_format_2_checkpoint_resumes_bit_exact(runs):
    for same, momentum, in_flight in (r["format2"] for r in runs):
        assert momentum and in_flight  # what format 2 kept, really loaded
        assert same


def test_resume_mid_round_with_fragments_and_an_outer_optimizer_is_bit_exact(runs):
    for r in runs:
        for (spec, _), (same, step) in zip(RESUME, r["resume"]):
            assert same, spec
            assert step == EXCHANGES.get(spec, STEPS // H * 2), spec


# ---------------------------------------------------------------- refusals
def _refusals(rank, world):
    out = []
    cases = [("allreduce:local_steps=4,fragments=5", {}),
             ("allreduce:local_steps=4,fragments=4", {"net": nn.Linear(32, 32)}),
             ("allreduce:local_steps=4", {"outer_optimizer": torch.optim.SGD(
                 [torch.zeros(1)], lr=1.0)}),
             ("allreduce", {"outer_optimizer": lambda p: torch.optim.SGD(p, lr=1.0)}),
             ("allreduce:local_steps=4", {"outer_optimizer": lambda p: p})]
    for spec, kw in cases:
        model = DDP(kw.pop("net", None) or _net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            gradcomp.register(model, spec, optimizer=opt, **kw)
            out.append(None)
        except (ValueError, TypeError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        assert not getattr(opt, "_gradcomp_local_hooks", None)  # nothing attached
    return out


def test_bad_fragments_and_outer_optimizers_are_named_on_every_rank(runs):
    for msgs in (r["refusals"] for r in runs):
        assert "invalid fragments=5: allowed an integer in [1, local_steps=4]" in msgs[0]
        assert "fragments=4: the model's 2 parameters leave fragment(s)" in msgs[1]
        assert msgs[2].startswith("TypeError: outer_optimizer=") and "callable" in msgs[2]
        assert "outer_optimizer= with local_steps=1" in msgs[3]
        assert msgs[4].startswith("TypeError: outer_optimizer built list")


def _everything(rank, world, path):
    from conftest import record_collectives
    out = {
        "by_hand": {F: _by_hand(rank, world, F) for F in (2, 4)},
        "outer": _outer(rank, world),
        "resume": _resume(rank, world, path),
        "format2": _resume_format2(rank, world, path),
        "refusals": _refusals(rank, world),
    }
    log = record_collectives(rank)  # last: it wraps torch.distributed for the process
    out["agree"] = {spec: _trajectory(rank, world, spec, log) for spec in AGREE}
    out["peak"] = {spec: _trajectory(rank, world, spec, log) for spec in PEAK}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return spawn(_everything, 2, args=(str(tmp_path_factory.mktemp("fragments")),))


# ---------------------------------------------------------------- HSDP
def _hsdp(rank, world):
    from test_fsdp import _local, _net as _sharded, _train
    net = _sharded(world, True)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    state = gradcomp.register(net, "sparseloco:local_steps=4,fragments=2,chunk=64,k=8,"
                                   "min_numel=0", optimizer=opt)
    # what the rounds lay out: this rank's rows of each parameter it holds rows of
    laid = [p.requires_grad and t.numel() > 0 for p, t in zip(net.parameters(), _local(net))]
    where = fragment_of([t.numel() for t, x in zip(_local(net), laid) if x], 2)
    agree = []
    for s in range(2 * H):
        _train(net, opt, rank, range(s, s + 1))
        mine = [t for t, x in zip(_local(net), laid) if x]
        same = []
        for t in mine:
            got = [torch.empty_like(t) for _ in range(dist.get_world_size(state._state.group))]
            dist.all_gather(got, t, group=state._state.group)
            same.append(all(torch.equal(g, t) for g in got))
        agree.append(same)
    stats = state.stats()
    state.close()
    return where, agree, stats["run_ratio"]


def test_hsdp_replicas_agree_on_a_fragment_after_its_exchange():
    for where, agree, ratio in spawn(_hsdp, 4, timeout=300):
        assert sorted(set(where)) == [0, 1]
        for s, same in enumerate(agree):
            synced = _syncs(2, s + 1)
            assert same == [g in synced for g in where], (s + 1, same)
        assert ratio > 2, ratio
