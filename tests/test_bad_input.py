"""Bad options are refused by name before anything runs: None where it means nothing,
non-finite numbers, a key given twice in a spec, a method that is not a string, sparse
embeddings (on every rank)."""
import re
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp


@pytest.mark.parametrize("spec,options,match", [
    ("topk", {"ratio": None}, "invalid ratio=None"),
    ("powersgd", {"rank": None}, "invalid rank=None"),
    ("onebit", {"delay": None}, "invalid delay=None"),
    ("onebit", {"error_feedback": None}, "invalid error_feedback=None"),
    ("onebit", {"seed": None}, "invalid seed=None"),
    ("dgc", {"weight_decay": float("inf")}, "invalid weight_decay=inf"),
    ("topk", {"ratio": float("nan")}, "invalid ratio=nan"),
    ("threshold", {"tau": 1e308 * 10}, "invalid tau=inf"),
    ("topk:ratio=0.1,ratio=0.2", {}, "given twice"),
    (None, {}, "method must be a name or spec string"),
    (3, {}, "method must be a name or spec string"),
    ("dilocco", {}, r"unknown method 'dilocco' \(did you mean 'diloco'\?\)"),
])
def test_refused_by_name(spec, options, match):
    with pytest.raises((TypeError, ValueError), match=match):
        gradcomp.build_config(spec, **options)


def test_none_still_means_the_default_where_it_is_documented():
    assert gradcomp.build_config("onebit", dense_steps=None)[1].dense_steps is None
    assert gradcomp.build_config("threshold", tau=None)[1].tau is None


def _sparse_embedding(rank, world):
    net = nn.Sequential(nn.Embedding(100, 8, sparse=True), nn.Linear(8, 2))
    try:
        gradcomp.register(DDP(net), "onebit")
    except ValueError as exc:
        return str(exc)


def test_sparse_embedding_is_refused_by_name_on_every_rank(spawn):
    for msg in spawn(_sparse_embedding, 2, timeout=60):
        assert msg and "'0'" in msg and "sparse=True" in msg


def _damaged_checkpoints(rank, world):
    """Every damaged checkpoint is refused by name and leaves the state as it was."""
    import copy
    from gradcomp.hooks.checkpoint import tensor_digest
    from conftest import small_net, train_steps
    net = small_net()
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = gradcomp.register(model, "topk:ratio=0.05,delay=1,warmup=none", optimizer=opt,
                              min_numel=0)
    train_steps(model, opt, rank, range(3))
    good = state.state_dict()
    before, step = tensor_digest(good), state.step
    assert good["pending"], "a delayed exchange is owed at the checkpoint"
    name = next(iter(good["memory"]["flat"]["residual"]))

    def edit(fn):
        sd = copy.deepcopy(good)
        fn(sd)
        return sd

    def flip(sd):
        sd["memory"]["flat"]["residual"][name].view(-1)[0] += 1.0

    def nan(sd):
        sd["memory"]["flat"]["residual"][name].view(-1)[0] = float("nan")
        sd.pop("digest")

    other = good["rank"] ^ 1
    cases = {
        "not a dict": ([1, 2], "expected the dict"),
        "partial": (edit(lambda sd: sd.pop("memory")), "missing key"),
        "future format": (edit(lambda sd: sd.update(format=99)), "format is 99"),
        "flipped bytes": (edit(flip), "do not match the digest"),
        "non-finite memory": (edit(nan), "inf/NaN"),
        "another rank's": (edit(lambda sd: sd.update(rank=other)), f"written by rank {other}"),
        "negative step": (edit(lambda sd: sd.update(step=-3)), "step is -3"),
        "step a float": (edit(lambda sd: sd.update(step=2.5)), "step is 2.5"),
        "another method": (edit(lambda sd: sd.update(method="onebit")), "for method 'onebit'"),
        "pending wrong size": (edit(lambda sd: (
            sd["pending"][0]["corrections"].update(
                {k: torch.zeros(3) for k in sd["pending"][0]["corrections"]}),
            sd.pop("digest"))), "holds 3 elements"),
        "pending unknown parameter": (edit(lambda sd: (
            sd["pending"][0]["corrections"].update({"nope.weight": torch.zeros(3)}),
            sd.pop("digest"))), "'nope.weight'"),
    }
    out = {}
    for label, (sd, match) in cases.items():
        try:
            state.load_state_dict(sd)
            out[label] = "loaded"
        except (TypeError, ValueError) as exc:
            out[label] = "ok" if match in str(exc) else f"wrong message: {exc}"
        now = state.state_dict()
        if tensor_digest(now) != before or state.step != step or len(now["pending"]) != len(good["pending"]):
            out[label] += " / state changed"
    state.load_state_dict(good)  # the intact one still loads
    out["intact"] = "ok" if tensor_digest(state.state_dict()) == before else "differs"
    legacy = {k: v for k, v in good.items() if k not in ("format", "rank", "digest")}
    state.load_state_dict(legacy)  # a checkpoint of gradcomp <= 0.1 (format 1) loads
    out["format 1"] = "ok" if tensor_digest(state.state_dict()) == before else "differs"
    return out


def test_a_damaged_checkpoint_is_refused_by_name_and_changes_nothing(spawn):
    for out in spawn(_damaged_checkpoints, 2, timeout=120):
        bad = {k: v for k, v in out.items() if v != "ok"}
        assert not bad, bad


@pytest.mark.parametrize("spec,options,match", [
    ("onebit", {"delay": 10**12}, "invalid delay=1000000000000: allowed an integer in [0, 64]"),
    ("topk", {"local_steps": 10**12}, "invalid local_steps=1000000000000"),
    ("onebit", {"chunk": 2**40}, "invalid chunk=1099511627776: allowed a positive multiple of 8, at most"),
    ("powersgd", {"rank": 10**9}, "invalid rank=1000000000"),
    ("threshold", {"tau": 1e308, "adaptive": False}, "invalid tau=1e+308"),
    ("onebit", {"seed": -1}, "invalid seed=-1"),
])
def test_values_past_what_they_cost_are_refused(spec, options, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        gradcomp.build_config(spec, **options)


def _one_rank_loads(rank, world, spec, fsdp):
    """Rank 0 rolls back to its step-3 checkpoint alone, while the others train on: its load
    waits for them, raises, and changes nothing; then training goes on on every rank."""
    from gradcomp.hooks import checkpoint
    from gradcomp.hooks.checkpoint import tensor_digest
    from conftest import small_net, train_steps
    checkpoint.LOAD_TIMEOUT_S = 3.0  # (the load group is made at registration, with it)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = (init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
                if world > 2 else init_device_mesh("cpu", (world,)))
        net = small_net()
        for m in net[::2]:
            fully_shard(m, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        net = small_net()
        model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = gradcomp.register(model, spec, optimizer=opt, warmup="none", min_numel=0)
    train_steps(model, opt, rank, range(3))
    sd = state.state_dict()
    train_steps(model, opt, rank, range(3, 5))
    before = state.state_dict()
    error = None
    if rank == 0:
        try:
            state.load_state_dict(sd)
        except RuntimeError as exc:
            error = str(exc)
    after = state.state_dict()
    unchanged = tensor_digest(after) == tensor_digest(before) and after["step"] == 5
    train_steps(model, opt, rank, range(5, 7))  # every rank goes on, at the same step
    return error, unchanged, state.step


@pytest.mark.parametrize("spec,fsdp,world", [("onebit", False, 2), ("topk", True, 2),
                                             ("terngrad", True, 4)], ids=["ddp", "fsdp2", "hsdp2x2"])
def test_a_checkpoint_loaded_on_one_rank_only_raises_there_and_changes_nothing(spec, fsdp, world,
                                                                               spawn):
    """A load is collective: the ranks agree over a process group of its own (no exchange
    uses it, so the rank waiting there cannot meet another's exchange as one collective).
    A rank that loads alone raises at the load once the others have not joined in
    LOAD_TIMEOUT_S, its state unchanged, and every rank trains on."""
    out = spawn(_one_rank_loads, world, args=(spec, fsdp), timeout=150, pg_timeout=30)
    error, unchanged, step = out[0]
    assert error and "gradcomp's load_state_dict is collective" in error, error
    assert "LOAD_TIMEOUT_S" in error, error
    assert f"rank(s) {', '.join(map(str, range(1, world)))} did not call it" in error, error
    assert all(u for _, u, _ in out), out
    assert [s for _, _, s in out] == [7] * world and all(e is None for e, _, _ in out[1:])


def _bad_arguments(rank, world):
    """Registrations with something wrong on one rank (or both): every rank raises, none
    waits for the others; returns each rank's (exception type, message) per case."""
    from conftest import small_net
    long_spec = "topk:" + "ratio=0.1," * 1000
    cases = {
        "optimizer object on rank 1": ("dgc", lambda o: {"optimizer": object() if rank else o}),
        "optimiser": ("dgc", lambda o: {"optimiser": o}),
        "scaler object on rank 1": ("topk", lambda o: {"scaler": object() if rank else None}),
        "lanes a string on rank 0": ("topk", lambda o: {"lanes": "4" if rank == 0 else 4}),
        "log_details a string on rank 1": ("topk", lambda o: {"log_details": "yes" if rank else
                                                              False}),
        "a plain module on rank 1": ("topk", lambda o: {}),
        "a repeated option in a long spec": (long_spec, lambda o: {}),
        "log_dir not writable on rank 0": ("topk", lambda o: {
            "log_dir": "/proc/gradcomp-runs" if rank == 0 else None}),
    }
    out = {}
    for label, (spec, kw) in cases.items():
        model = DDP(small_net())  # (collective: every rank wraps its model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        target = model.module if label == "a plain module on rank 1" and rank == 1 else model
        try:
            gradcomp.register(target, spec, **kw(opt)).close()
            out[label] = None
        except Exception as exc:  # noqa: BLE001
            out[label] = (type(exc).__name__, str(exc))
    return out


def test_bad_arguments_on_one_rank_are_refused_on_every_rank_without_a_hang(spawn):
    """Every argument of gradcomp.register, objects included, is checked inside the ranks'
    first agreement: a rank given something wrong raises its own error, the others a
    ValueError naming it (an invalid optimizer on one rank left the others waiting); a
    misspelled keyword is named with the nearest valid one; messages stay short."""
    r0, r1 = spawn(_bad_arguments, 2, timeout=180)

    def both(label, own_rank, kind, *words):
        own, other = (r0, r1) if own_rank == 0 else (r1, r0)
        assert own[label] and own[label][0] == kind, (label, own[label])
        assert other[label] and other[label][0] == "ValueError", (label, other[label])
        assert f"refused on rank(s) {own_rank}, so on every rank" in other[label][1]
        for w in words:
            assert w in own[label][1] and w in other[label][1], (label, w, own, other)
    both("optimizer object on rank 1", 1, "TypeError", "optimizer=<object object",
         "allowed a torch.optim.Optimizer")
    both("scaler object on rank 1", 1, "TypeError", "allowed a torch.amp.GradScaler")
    both("lanes a string on rank 0", 0, "ValueError", "invalid lanes='4'")
    both("log_details a string on rank 1", 1, "TypeError", "log_details='yes'")
    both("a plain module on rank 1", 1, "TypeError", "needs a torch.nn.parallel")
    both("log_dir not writable on rank 0", 0, "ValueError", "log_dir='/proc/gradcomp-runs'")
    for r in (r0, r1):
        kind, msg = r["optimiser"]
        assert kind == "ValueError" and "unknown keyword 'optimiser'" in msg, msg
        assert "did you mean 'optimizer'?" in msg, msg
        kind, msg = r["a repeated option in a long spec"]
        assert "option 'ratio' given twice" in msg and len(msg) < 600, (len(msg), msg[:200])


def _disagree(rank, world, case):
    from conftest import small_net
    torch.manual_seed(0)
    net = small_net()
    if case == "model" and rank == 1:  # the same shapes (DDP's own check), other names
        net = nn.Sequential(OrderedDict((f"layer{i}", m) for i, m in enumerate(net)))
    if case == "embedding":
        net.append(nn.Embedding(3, 2, sparse=rank == 1))
    model = DDP(net)
    momentum = 0.9 if rank == 0 or case != "momentum" else 0.8
    cls = torch.optim.Adam if case == "optimizer" and rank == 1 else torch.optim.SGD
    kw = {"momentum": momentum} if cls is torch.optim.SGD else {}
    opt = cls(model.parameters(), lr=0.1, **kw)
    lanes = 10**6 if case == "lanes" and rank == 1 else 2
    try:
        gradcomp.register(model, "onebit", optimizer=opt, lanes=lanes)
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("case,match", [
    ("momentum", "optimizer group 0: rank 0: {"),
    ("optimizer", "optimizer: rank 0: SGD, rank 1: Adam"),
    ("model", "parameters (names, shapes, dtypes): rank 0:"),
    ("lanes", "invalid lanes=1000000: allowed an integer in [1, 32]"),
    ("embedding", "(sparse=True)"),
])
def test_ranks_that_disagree_all_refuse_naming_what(case, match, spawn):
    for msg in spawn(_disagree, 2, args=(case,), timeout=90):
        assert msg and match in msg, msg


def _misuse(rank, world, case):
    """Registration misuses that torch would otherwise meet later, with its own error (or a
    silently unaveraged gradient): each refused on every rank, nothing left attached."""
    import sys

    import torch.distributed as dist
    from conftest import small_net
    model = DDP(small_net())
    kw = {}
    if case == "group":  # a group of other ranks than DDP's: each rank alone
        alone = [dist.new_group([r]) for r in range(world)]
        kw = {"process_group": alone[rank]}
    if case == "twice":
        gradcomp.register(model, "topk:ratio=0.5").close()
    if case == "torch hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    args = ()
    if case == "positional":  # the optimizer by position
        args = (torch.optim.SGD(model.parameters(), lr=0.1),)
    if case == "logdir":  # tensorboard is an optional extra: as if it were not installed
        sys.modules["torch.utils.tensorboard"] = None
        kw = {"log_dir": "/nonexistent/runs"}
    try:
        gradcomp.register(model, "topk:ratio=0.5", *args, **kw)
        error = None
    except (TypeError, ValueError) as exc:
        error = str(exc)
    if case == "logdir":  # nothing was attached: registering without it works
        del sys.modules["torch.utils.tensorboard"]
        gradcomp.register(model, "topk:ratio=0.5").close()
    return error


@pytest.mark.parametrize("case,match", [
    ("group", "process_group= holds ranks"),
    ("twice", "already has a communication hook: gradcomp's, registered with method 'topk'"),
    ("torch hook", "already has a communication hook: torch.distributed.algorithms."
                   "ddp_comm_hooks.default_hooks.allreduce_hook (registered with"),
    ("positional", "got 1 more positional argument(s) (SGD): write gradcomp.register(model, "
                   "'topk:ratio=0.5', optimizer=opt)"),
    ("logdir", "needs tensorboard"),
])
def test_registration_misuse_is_refused_on_every_rank(case, match, spawn):
    for msg in spawn(_misuse, 2, args=(case,), timeout=90):
        assert msg and match in msg, msg


def test_spaces_around_a_method_name_are_ignored():
    assert gradcomp.build_config(" topk : ratio = 0.1 ")[0] == "topk"


def _by_hand(rank, world):
    """The documented path for a hook registered by hand: gradcomp.State(..., model=)."""
    from conftest import batch, small_net, train_steps
    net = small_net()
    model = DDP(net)
    _, config = gradcomp.build_config("topk:ratio=0.1,warmup=none,min_numel=0")
    state = gradcomp.State("topk", config, model=net)
    model.register_comm_hook(state, gradcomp.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_steps(model, opt, rank, range(3))
    stats = state.stats()
    bare = DDP(small_net())
    bare.register_comm_hook(gradcomp.State("topk", config), gradcomp.hook)
    try:
        bare(batch(rank, 0)[0]).sum().backward()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return [p.detach().clone() for p in net.parameters()], stats, error


def test_a_state_registered_by_hand_runs_and_a_nameless_one_says_how(spawn):
    (p0, s0, e0), (p1, _, _) = spawn(_by_hand, 2, timeout=90)
    assert s0["step"] == 3 and 0 < s0["sent_bytes"] < s0["raw_bytes"]  # it compressed
    for a, b in zip(p0, p1):
        assert torch.equal(a, b)
    assert "gradcomp.State(method, config, model=net)" in e0


def test_register_without_a_process_group_says_so():
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        gradcomp.register(DDP.__new__(DDP), "onebit")


def _register_close_loop(rank, world, n):
    import gc
    import os
    import threading
    from conftest import small_net, train_steps

    def usage():
        gc.collect()
        rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return threading.active_count(), len(os.listdir("/proc/self/fd")), rss / 2**20

    net = small_net()
    seen = []
    for i in range(n):
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        state = gradcomp.register(model, "topk:warmup=none,min_numel=0,delay=1", optimizer=opt)
        train_steps(model, opt, rank, range(2))
        state.close()
        del model, opt, state
        if i in (1, n - 1):
            seen.append(usage())
    return seen


def test_register_train_close_100_times_leaks_no_threads_groups_or_memory(spawn):
    for (t0, f0, m0), (t1, f1, m1) in spawn(_register_close_loop, 2, args=(100,), timeout=300):
        assert t1 == t0, f"threads {t0} -> {t1}"
        assert f1 == f0, f"open files {f0} -> {f1} (process groups not destroyed?)"
        assert m1 - m0 < 32, f"RSS {m0:.0f} -> {m1:.0f} MiB"
