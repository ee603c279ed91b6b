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
    (T5, T10, small_net, "other options than this state's: ratio: saved 0.05, this state 0.1;"),
    (T5, T5, _other_net, "parameters this model lacks"),
    (T5, T5, _narrower_net, "elements for parameter"),
])
def test_a_checkpoint_for_something_else_is_refused(saved, new, net_fn, match, spawn):
    msgs = spawn(_load_into, 2, args=(saved, new, None, net_fn))
    assert all(m is not None and match in m for m in msgs), msgs
    assert not any("min_numel" in m for m in msgs)  # the options that differ, not all of them


def test_a_checkpoint_from_another_world_size_is_refused():
    st = gradcomp.State(*gradcomp.build_config("topk", min_numel=0))
    sd = st.state_dict()
    sd["world_size"] = 4
    with pytest.raises(ValueError, match="saved with world size 4; this job has 1"):
        st.load_state_dict(sd)


def test_a_checkpoint_is_compared_by_the_warm_up_that_runs():
    # warmup="auto" resolves to "adaptive" at local_steps=1 (what older checkpoints hold) and
    # to "none" under local_steps: a checkpoint naming the same rule loads, another does not
    st = gradcomp.State(*gradcomp.build_config("topk", min_numel=0))
    sd = st.state_dict()
    sd["config"]["warmup"] = "adaptive"
    st.load_state_dict(sd)
    sd["config"]["warmup"] = "none"
    with pytest.raises(ValueError, match="warmup: saved 'none', this state 'adaptive'; register"):
        st.load_state_dict(sd)
    loc = gradcomp.State(*gradcomp.build_config("topk:local_steps=4", min_numel=0))
    sd = loc.state_dict()
    assert sd["config"]["warmup"] == "auto"
    sd["config"]["warmup"] = "none"
    loc.load_state_dict(sd)
    sd["config"]["warmup"] = "adaptive"
    with pytest.raises(ValueError, match="warmup: saved 'adaptive', this state 'none'; register"):
        loc.load_state_dict(sd)


def test_a_checkpoint_written_before_growing_rounds_loads_as_the_run_it_was():
    # a checkpoint without grow_every (written before the option) ran its rounds at one
    # length: refused beside sparseloco's growing defaults, naming it; loads with grow_every=0
    st = gradcomp.State(*gradcomp.build_config("sparseloco", min_numel=0))
    sd = st.state_dict()
    for k in ("grow_every", "max_local_steps"):
        sd["config"].pop(k)
    with pytest.raises(ValueError, match="grow_every: saved 0, this state 500"):
        st.load_state_dict(sd)
    old = gradcomp.State(*gradcomp.build_config("sparseloco:grow_every=0", min_numel=0))
    old.load_state_dict(sd)


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


def _net128():  # PowerSGD groups its two 128-column matrices in one batch
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def _steps128(model, opt, rank, steps):
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 128, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _same(a, b) -> bool:
    """Equal checkpoints, tensors bit for bit, every other value too."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    return a == b


PSGD = "powersgd:rank=2,warmup=none"  # compressing from the first step


def _refused_loads(rank, world, sweep):
    """Refused loads, then training: the run must equal one that never tried them."""
    import copy
    import random

    def job():
        model = DDP(_net128(), bucket_cap_mb=0.01)
        opt = torch.optim.SGD(model.parameters(), **SGD)
        return model, opt, gradcomp.register(model, PSGD, optimizer=opt, min_numel=0)

    model, opt, state = job()
    _steps128(model, opt, rank, range(6))
    ref = [p.detach().clone() for p in model.parameters()]
    state.close()
    model, opt, state = job()
    _steps128(model, opt, rank, range(2))
    earlier = state.state_dict()
    _steps128(model, opt, rank, range(2, 3))
    good = state.state_dict()
    assert good["memory"]["tensors"]["q"]["0.weight"].shape == (128, 2)

    def edit(fn):
        sd = copy.deepcopy(good)
        sd.pop("digest")
        fn(sd)
        return sd

    def other_q(sd):  # another model's factor (64 columns), then a damaged warm-up entry:
        sd["memory"]["tensors"]["q"]["0.weight"] = torch.zeros(64, 2)  # checked last, the
        sd["warmup"]["entries"] = [(2, 5, torch.zeros(1))]  # load used to replace Q first

    cases = {
        "another model's Q": (edit(other_q), "holds a torch.float32 tensor of shape (64, 2)"),
        "a warm-up entry": (edit(lambda sd: sd["warmup"].update(entries=[(2, 5, torch.zeros(1))])),
                            "a warmup entry"),
        "Q in float64": (edit(lambda sd: sd["memory"]["tensors"]["q"].update(
            {"2.weight": sd["memory"]["tensors"]["q"]["2.weight"].double()})), "torch.float64"),
        "a config value a tensor": (edit(lambda sd: sd["config"].update(rank=torch.ones(2))),
                                    "config option 'rank'"),
        "rank 1 damaged": (edit(lambda sd: sd.update(step=-1)) if rank == 1 else good,
                           "step is -1" if rank == 1 else "refused on rank(s) 1, so on every rank"),
        "other steps": (earlier if rank == 1 else good, "step: rank 0: 3, rank 1: 2"),
    }
    rng = random.Random(sweep)
    paths = []

    def walk(d, pre=()):
        for k, v in (d.items() if isinstance(d, dict) else enumerate(d)):
            paths.append(pre + (k,))
            if isinstance(v, (dict, list)):
                walk(v, pre + (k,))
    walk({k: v for k, v in good.items() if k != "digest"})
    values = [None, -1, 2.5, "x", [], {}, torch.zeros(3), torch.zeros(64, 2), torch.ones(2, 2),
              torch.zeros(3).to_sparse(), torch.empty(3, device="meta")]
    for i in range(sweep):  # the same garbles on every rank (one seed)
        sd = copy.deepcopy(good)
        sd.pop("digest")
        for _ in range(rng.randint(1, 2)):
            *where, key = rng.choice(paths)
            d = sd
            for k in where:
                d = d[k] if isinstance(d, (dict, list)) and (
                    k in d if isinstance(d, dict) else k < len(d)) else None
            if isinstance(d, (dict, list)) and not isinstance(d, tuple):
                try:
                    d[key] = copy.deepcopy(rng.choice(values))
                except (IndexError, TypeError):
                    pass
        cases[f"garbled {i}"] = (sd, None)
    out = {}
    for label, (sd, match) in cases.items():
        try:
            state.load_state_dict(sd)
            out[label] = "loaded" if match else "ok"
            state.load_state_dict(good)  # (what a garble changed, if it loaded: put back)
        except (TypeError, ValueError) as exc:
            out[label] = "ok" if match is None or match in str(exc) else f"message: {exc}"
        if not _same(state.state_dict(), good):
            out[label] += " / state changed"
    _steps128(model, opt, rank, range(3, 6))  # training goes on as if nothing happened
    out["equal"] = all(torch.equal(a, p) for a, p in zip(ref, model.parameters()))
    return out


def test_a_refused_load_leaves_the_state_as_it_was_on_every_rank(spawn):
    """Each load of a damaged or foreign checkpoint is refused, by name, on every rank at the
    load itself (a rank whose own checkpoint was fine refuses with the others), and leaves
    the state as it was: training then equals a run that never tried them, bit for bit. A
    seeded sweep of garbled checkpoints is each refused with a TypeError/ValueError (state
    unchanged) or loads whole."""
    for out in spawn(_refused_loads, 2, args=(40,), timeout=240):
        bad = {k: v for k, v in out.items() if v not in ("ok", True)}
        assert not bad, bad


def _dcp_itself(rank, world, spec, path):
    """torch.distributed.checkpoint given the state itself (not ``state.stateful()``): save
    after K steps, load into a state that ran steps of its own; returns the load's error and
    whether the state is as it was before the load."""
    import torch.distributed.checkpoint as dcp
    net, model, opt, state = _job(spec)
    _steps(model, opt, rank, range(K))
    dcp.save({"gradcomp": state}, checkpoint_id=path)
    state.close()
    net, model, opt, state = _job(spec)
    _steps(model, opt, rank, range(K))
    before = state.state_dict()
    try:
        dcp.load({"gradcomp": state}, checkpoint_id=path)
        error = None
    except (ValueError, TypeError) as exc:
        error = str(exc)
    after = state.state_dict()
    same = before["digest"] == after["digest"] and before["step"] == after["step"]
    state.close()
    return error, same


def test_dcp_given_the_state_itself_is_refused_at_the_load_naming_stateful(tmp_path, spawn):
    """``dcp.save({"gradcomp": state})``: DCP keeps one rank's copy of equal keys (each rank's
    residuals are its own) and loads only keys a fresh state already holds, so the plain
    dict does not come back whole: the load is refused on every rank, naming
    ``state.stateful()``, and leaves the state as it was."""
    for error, same in spawn(_dcp_itself, 2, args=("powersgd:rank=1,warmup=none", str(tmp_path)),
                             timeout=180):
        assert error is not None and "state.stateful()" in error, error
        assert same


def _exchange_error(rank, world):
    net, model, opt, state = _job("topk:ratio=0.05,warmup=none")
    _steps(model, opt, rank, range(2))
    if rank == 1:
        state._state.resume_at(state.step + 3)  # as if this rank's state had been built anew
    out = []
    for step in (2, 3, 4):
        try:
            _steps(model, opt, rank, range(step, step + 1))
            out.append(None)
        except Exception as exc:  # noqa: BLE001
            out.append((type(exc).__name__, str(exc)))
    return out


def test_an_error_inside_an_exchange_reaches_the_user_as_itself(spawn):
    """The step check fails where the step's flags are read, at the next step's first bucket
    (hooks/guard.py): DDP reads the hook's future from C++, and the error reaches backward's
    caller as gradcomp raised it (its type, its message), not as "Unable to cast ... to
    Tensor"; the next step names the earlier one."""
    for trained, first, second in spawn(_exchange_error, 2, timeout=120):
        assert trained is None  # the step's flag is read at the next step's start
        assert first[0] == "RuntimeError" and first[1].startswith(
            "gradcomp: the ranks are at different steps of this state (from step 2 to 5"), first
        assert second[0] == "RuntimeError" and second[1].startswith(
            "gradcomp: an earlier exchange failed: gradcomp: the ranks are at different"), second


# ---------------------------------------------------------------- local steps' slips
LOCAL = "topk:ratio=0.05,local_steps=3"


def _local_job(rank):
    from conftest import small_net
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = gradcomp.register(model, LOCAL, optimizer=opt, min_numel=0, lanes=1)
    return net, model, opt, state


def _slips(rank, world, path):
    """A local-steps job saved mid-round (each rank its own model and state), then resumed
    three ways: each rank's own model without gradcomp's state (the first step raises),
    rank 0's model on every rank with each rank's own state (the load raises), each rank's
    own model and state (goes on). Returns each resume's error (None: none)."""
    from conftest import train_steps
    net, model, opt, state = _local_job(rank)
    train_steps(model, opt, rank, range(4))  # inner step 1 of round 2: the ranks differ
    torch.save({"model": net.state_dict(), "gradcomp": state.state_dict()},
               f"{path}/rank{rank}.pt")
    state.close()
    torch.distributed.barrier()
    own = torch.load(f"{path}/rank{rank}.pt")
    rank0 = torch.load(f"{path}/rank0.pt")
    out = {}
    for case, model_sd, gc_sd in (("no gradcomp state", own["model"], None),
                                  ("rank 0's model", rank0["model"], own["gradcomp"]),
                                  ("own model and state", own["model"], own["gradcomp"])):
        net, model, opt, state = _local_job(rank)
        net.load_state_dict(model_sd)
        try:
            if gc_sd is not None:
                state.load_state_dict(gc_sd)
            train_steps(model, opt, rank, range(4, 6))
            out[case] = None
        except ValueError as exc:
            out[case] = str(exc)
        state.close()
    return out


def test_local_steps_checkpoint_slips_raise_on_every_rank(spawn, tmp_path):
    """Inside a round the ranks' models differ: resumed without gradcomp's state, the first
    step raises (each rank's rounds would start from its own point for good); gradcomp's
    state loaded beside rank 0's model raises at the load; each rank's own model and state
    resume. Every rank raises, each naming the fix."""
    for rank, out in enumerate(spawn(_slips, 2, args=(str(tmp_path),), timeout=120)):
        first = out["no gradcomp state"]
        assert first and "models differ at the first step of local steps" in first, first
        assert "rank(s) 1 from rank 0's" in first and "state.load_state_dict" in first
        load = out["rank 0's model"]
        if rank == 1:
            assert load and "not the one its gradcomp state was saved with" in load, load
            assert "each rank saves and loads its own model" in load
        else:  # rank 0's model is its own: refused because rank 1 refused
            assert load and "refused on rank(s) 1, so on every rank" in load, load
        assert out["own model and state"] is None
