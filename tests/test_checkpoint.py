"""Checkpoints: train k steps, save model + optimizer + hook state, restore into fresh
processes, train k more; the model must equal that of 2k uninterrupted steps, bit for bit.

The resumed job meets DDP's *initial* bucket layout at its first step, where the
uninterrupted job already runs on the rebuilt one: the buckets below are tiny so the two
layouts differ, and exactness holds only because every method's result for a parameter
depends on that parameter alone.

The methods' specs compress from the first step (``warmup=none``); the adaptive warm-up has
specs of its own whose switch comes before the checkpoint, at the resumed job's first step,
and after it (the checkpoint then holds half a window)."""
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from conftest import small_net, train_steps

K = 4
SGD = {"lr": 0.05, "momentum": 0.9}
METHODS = ["allreduce", "topk:ratio=0.05", "dgc:ratio=0.02,warmup_steps=6",
           "onebit:chunk=64", "terngrad", "terngrad:error_feedback=true", "powersgd:rank=1",
           "onebit:chunk=64,delay=2",
           "dgc:ratio=0.05,delay=1", "threshold:max_ratio=0.05"]
# adaptive warm-up: spec -> its first compressed step (threshold 100: at the second window's
# end; the default 0.5 where the data decide, the same in both runs)
WARMUPS = {"onebit:chunk=64,warmup_window=1,warmup_threshold=100": 2,
           "onebit:chunk=64,warmup_window=2,warmup_threshold=100": K,
           "powersgd:rank=1,warmup_window=3,warmup_threshold=100": 6,
           "dgc:ratio=0.05,delay=1,warmup_window=3,warmup_threshold=100": 6,
           "topk:ratio=0.05,warmup_window=1": None}
SPECS = [f"{s},warmup=none" if ":" in s else f"{s}:warmup=none" for s in METHODS] + list(WARMUPS)
SCHEDULE = ("compressing", "warmup_switch_step", "warmup_norm_change")


def _job(spec):
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    state = gradcomp.register(model, spec, optimizer=opt, min_numel=0)
    return net, model, opt, state


_steps = train_steps


def _uninterrupted(rank, world, spec):
    net, model, opt, state = _job(spec)
    _steps(model, opt, rank, range(2 * K))
    return [p.detach().clone() for p in net.parameters()], [state.stats()[k] for k in SCHEDULE]


def _first_half(rank, world, spec, path):
    net, model, opt, state = _job(spec)
    _steps(model, opt, rank, range(K))
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "gradcomp": state.state_dict()},
               f"{path}/rank{rank}.pt")


def _second_half(rank, world, spec, path):
    net, model, opt, state = _job(spec)
    ck = torch.load(f"{path}/rank{rank}.pt")
    net.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    state.load_state_dict(ck["gradcomp"])
    _steps(model, opt, rank, range(K, 2 * K))
    return ([p.detach().clone() for p in net.parameters()], state.step,
            [state.stats()[k] for k in SCHEDULE])


@pytest.mark.parametrize("spec", SPECS)
def test_resume_in_fresh_processes_is_bit_exact(spec, tmp_path, spawn):
    ref, schedule = spawn(_uninterrupted, 2, args=(spec,))[0]
    spawn(_first_half, 2, args=(spec, str(tmp_path)))
    got, step, resumed = spawn(_second_half, 2, args=(spec, str(tmp_path)))[0]
    assert step == 2 * K
    assert resumed == schedule  # the window ratio too, bit for bit
    if spec in WARMUPS:
        assert schedule[1] is not None, f"{spec}: no switch in {2 * K} steps ({schedule})"
        if WARMUPS[spec] is not None:
            assert schedule[1] == WARMUPS[spec]
    for a, b in zip(ref, got):
        assert torch.equal(a, b), f"{spec}: max diff {(a - b).abs().max():.3g}"


def _load_into(rank, world, spec_saved, spec_new, path, net_fn):
    net, model, opt, state = _job(spec_saved)
    _steps(model, opt, rank, range(2))
    sd = state.state_dict()
    model2 = DDP(net_fn(), bucket_cap_mb=0.004)
    opt2 = torch.optim.SGD(model2.parameters(), **SGD)
    other = gradcomp.register(model2, spec_new, optimizer=opt2, min_numel=0)
    try:
        other.load_state_dict(sd)
    except ValueError as exc:
        return str(exc)
    return None


def _narrower_net():  # the same parameter names, other shapes
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 48), nn.Tanh(),
                         nn.Linear(48, 10))


def _other_net():  # other parameter names
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.Linear(64, 10))


# compressing from the first step (warmup=none): the checkpoint then holds memory to check
T5, T10 = "topk:ratio=0.05,warmup=none", "topk:ratio=0.1,warmup=none"


@pytest.mark.parametrize("saved, new, net_fn, match", [
    (T5, "onebit", small_net, "checkpoint is for method 'topk'"),
    (T5, T10, small_net, "checkpoint is for method 'topk'"),
    (T5, T5, _other_net, "parameters this model lacks"),
    (T5, T5, _narrower_net, "elements for parameter"),
])
def test_a_checkpoint_for_something_else_is_refused(saved, new, net_fn, match, spawn):
    msgs = spawn(_load_into, 2, args=(saved, new, None, net_fn))
    assert all(m is not None and match in m for m in msgs), msgs


def test_a_checkpoint_from_another_world_size_is_refused():
    st = gradcomp.GradcompState(*gradcomp.build_config("topk", min_numel=0))
    sd = st.state_dict()
    sd["world_size"] = 4
    with pytest.raises(ValueError, match="saved with world size 4; this job has 1"):
        st.load_state_dict(sd)


def test_a_checkpoint_is_compared_by_the_warm_up_that_runs():
    # warmup="auto" resolves to "adaptive" at local_steps=1 (what older checkpoints hold) and
    # to "none" under local_steps: a checkpoint naming the same rule loads, another does not
    st = gradcomp.GradcompState(*gradcomp.build_config("topk", min_numel=0))
    sd = st.state_dict()
    sd["config"]["warmup"] = "adaptive"
    st.load_state_dict(sd)
    sd["config"]["warmup"] = "none"
    with pytest.raises(ValueError, match="checkpoint is for method 'topk'"):
        st.load_state_dict(sd)
    loc = gradcomp.GradcompState(*gradcomp.build_config("topk:local_steps=4", min_numel=0))
    sd = loc.state_dict()
    assert sd["config"]["warmup"] == "auto"
    sd["config"]["warmup"] = "none"
    loc.load_state_dict(sd)
    sd["config"]["warmup"] = "adaptive"
    with pytest.raises(ValueError, match="checkpoint is for method 'topk'"):
        loc.load_state_dict(sd)


ROLLBACK = ["onebit:chunk=64,delay=1,warmup=none", "dgc:ratio=0.05,delay=1,warmup=none",
            "topk:ratio=0.05,delay=2,warmup=none", "powersgd:rank=1,warmup=none",
            "topk:ratio=0.05,local_steps=3,local_delay=1",
            "onebit:chunk=64,warmup_window=1,warmup_threshold=100"]


def _rollback(rank, world, spec):
    """A checkpoint loaded into a state that has run on past it (a rollback, a retry after a
    bad step) is a fresh-process resume: the run then equals one that never left it."""
    import copy
    net, model, opt, state = _job(spec)
    _steps(model, opt, rank, range(2 * K))
    ref = [p.detach().clone() for p in net.parameters()]
    net, model, opt, state = _job(spec)
    _steps(model, opt, rank, range(K))
    saved = copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict(),
                           "gradcomp": state.state_dict()})
    _steps(model, opt, rank, range(100, 103))  # the steps rolled back
    net.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["gradcomp"])
    _steps(model, opt, rank, range(K, 2 * K))
    return [float((a - p).abs().max()) for a, p in zip(ref, net.parameters())]


@pytest.mark.parametrize("spec", ROLLBACK)
def test_loading_into_a_running_state_equals_a_fresh_resume(spec, spawn):
    for diffs in spawn(_rollback, 2, args=(spec,), timeout=120):
        assert max(diffs) == 0, f"{spec}: max diff {max(diffs):.3g}"
