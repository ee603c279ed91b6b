"""Shared by the tests: the Triton interpreter environment, the spawn launcher, small nets and
their batches, bucket layouts, and the CIFAR-10 subset.

Helpers that run inside spawned ranks (``small_net``, ``batch``, ``train_pair``,
``train_capturing``, ``record_collectives``) are plain functions, imported as
``from conftest import ...``: a rank unpickles them by name, which a fixture's value cannot
be. The launcher is the ``spawn`` fixture.

The data-dependent tests (convergence, training, delay) take the ``cifar`` fixture: where
the data is missing they skip, unless ``GRADCOMP_REQUIRE_DATA=1`` (what ``.ci/run`` sets),
where they fail, so CI cannot stay green without the data it is meant to test on.
"""
import inspect
import math
import os
import random
import socket
import subprocess
import sys
import threading
import time

# Triton kernels run on CPU tensors through the interpreter unless asked otherwise
# (TRITON_INTERPRET=0 on a GPU machine). Set first, before anything imports triton;
# spawned ranks inherit it.
os.environ.setdefault("TRITON_INTERPRET", "1")
# the CPU steps run the pure-torch path, bit-identical to the reference, unless a test asks for
# another: the compiled path's compile (tens of seconds per process) would dominate hundreds
# of short multi-process tests; tests/test_compiled.py opts in
os.environ.setdefault("GRADCOMP_KERNELS", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradcomp  # noqa: E402
from gradcomp.compressors.base import ParamSlice  # noqa: E402


@pytest.fixture(scope="session")
def spawn():
    """The launcher: ``spawn(fn, world, args=..., timeout=...)`` runs ``fn(rank, world, *args)``
    on gloo ranks and returns their results (gradcomp_bench.launch.spawn)."""
    from gradcomp_bench.launch import spawn
    return spawn


@pytest.fixture(scope="session")
def cifar():
    """The CIFAR-10 directory the tests train on."""
    from gradcomp_bench import data
    found = data.resolve(None)
    if found is None:
        where = ", ".join(str(d) for d in data.default_dirs())
        if os.environ.get("GRADCOMP_REQUIRE_DATA") == "1":
            pytest.fail(f"GRADCOMP_REQUIRE_DATA=1 but no CIFAR-10 data in any of: {where}")
        pytest.skip(f"needs the CIFAR-10 subset (looked in: {where})")
    return found


# --------------------------------------------------------------------------- bucket layouts
SHAPES = {"fc.weight": (48, 40), "fc.bias": (48,), "conv.weight": (16, 8, 3, 3)}


def lay_out(shapes):
    """A bucket of ``(name, shape)`` pairs, in that order."""
    out, off = [], 0
    for name, shape in shapes:
        numel = math.prod(shape)
        out.append(ParamSlice(name, tuple(shape), off, numel))
        off += numel
    return out


def layout(names):
    """A bucket holding the parameters ``names`` of SHAPES, in that order."""
    return lay_out([(n, SHAPES[n]) for n in names])


def state_for(spec, **kw):
    """A one-process state for ``spec``, compressing every tensor (min_numel=0) from its
    first step (the adaptive warm-up would start dense)."""
    if "warmup=" not in spec:
        kw.setdefault("warmup", "none")
    name, cfg = gradcomp.build_config(spec, min_numel=0, **kw)
    return gradcomp.State(name, cfg)


class Scalars:
    """A SummaryWriter stand-in that keeps what it is given: ``seen[tag] == [values]``."""

    def __init__(self):
        self.seen = {}

    def add_scalar(self, tag, value, step):
        self.seen.setdefault(tag, []).append(value)


# --------------------------------------------------------------------------- nets and ranks
def small_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 48), nn.Tanh(),
                         nn.Linear(48, 10))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g)


def train_steps(model, opt, rank, steps):
    """Cross-entropy steps of ``model`` on ``batch(rank, step)`` for each step in ``steps``."""
    for step in steps:
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def train_pair(rank, world, spec, sgd, steps, baseline=None, stats=False):
    """Train ``baseline`` (None: plain DDP) and DDP + ``spec`` side by side from one init,
    compressed from the first step unless ``spec`` names its warm-up; return both models'
    parameters (``stats``: and ``spec``'s ``state.stats()`` after the last step)."""
    out, state = [], None
    for use in (baseline, spec):
        net = small_net()
        # tiny buckets: several per step, and DDP rebuilds them after the first iteration
        model = DDP(net, bucket_cap_mb=0.004)
        opt = torch.optim.SGD(model.parameters(), **sgd)
        if use:
            state = gradcomp.register(model, use, optimizer=opt, min_numel=0,
                                      **({} if "warmup=" in use else {"warmup": "none"}))
        for step in range(steps):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out.append([p.detach().clone() for p in net.parameters()])
    if stats:
        out.append(state.stats())
    return out


def train_capturing(rank, model, net, opt, steps, capture=True):
    """Train ``steps`` steps; return per parameter (float64, flat) the sum of this rank's
    local gradients (before communication; zeros unless ``capture``) and of the averaged
    gradients the optimizer applied."""
    local = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in net.named_parameters()}
    avg = {n: torch.zeros_like(v) for n, v in local.items()}

    def capture_into(name):
        def fn(g):
            local[name].add_(g.reshape(-1).double())
        return fn
    if capture:
        for n, p in net.named_parameters():
            p.register_hook(capture_into(n))
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for n, p in net.named_parameters():
            avg[n] += p.grad.reshape(-1).double()
        opt.step()
    return local, avg


def record_collectives(rank):
    """Wrap torch.distributed's collectives: a random delay, then record and issue."""
    log, lock, rng = [], threading.Lock(), random.Random(1234 + 7 * rank)

    def wrap(name, fn):
        def wrapped(*args, group=None, **kw):
            with lock:
                pause = rng.uniform(0, 0.003)
            time.sleep(pause)
            t = args[0] if torch.is_tensor(args[0]) else args[1]
            with lock:
                log.append((getattr(group, "group_name", str(group)), name, t.numel()))
            return fn(*args, group=group, **kw)
        return wrapped
    for name in ("all_reduce", "all_gather", "all_to_all_single", "reduce_scatter_tensor"):
        setattr(dist, name, wrap(name, getattr(dist, name)))
    return log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script, *args, nproc=2, timeout=420, cwd=ROOT, env=None):
    """``python -m torch.distributed.run`` on this machine; the output on failure."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", str(script), *map(str, args)]
    try:
        run = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{(e.stdout or '')[-3000:]}"
                    f"{(e.stderr or '')[-3000:]}")
    assert run.returncode == 0, f"{' '.join(cmd)}\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return run


# ----------------------------------------------------------------------------- markers
# Every test gets one of three markers, from what it runs (no list kept by hand):
#   convergence  trains to an accuracy or loss (the cifar fixture, test_convergence*.py)
#   distributed  starts processes (the spawn fixture, torchrun, a subprocess, a link)
#   unit         the rest: one process, `pytest -m unit` for a quick loop
_STARTS_PROCESSES = ("spawn", "torchrun", "subprocess", "Link(", "Popen", "cli.main(")


def _source(module) -> str:
    try:
        return open(module.__file__).read()
    except (OSError, TypeError):
        return ""


def pytest_collection_modifyitems(config, items):
    cache = {}
    for item in items:
        mod = item.module
        src = cache.setdefault(mod.__name__, _source(mod))
        fn_src = ""
        for fn in [item.function] + [getattr(mod, f, None) for f in item.fixturenames]:
            fn = getattr(fn, "__wrapped__", None) or getattr(fn, "_get_wrapped_function",
                                                              lambda: fn)()
            try:  # the test's own source and its module's fixtures'
                fn_src += inspect.getsource(fn) if callable(fn) else ""
            except (OSError, TypeError):
                pass
        if "cifar" in item.fixturenames or mod.__name__.startswith("test_convergence"):
            item.add_marker(pytest.mark.convergence)
        elif "spawn" in item.fixturenames or any(s in fn_src for s in _STARTS_PROCESSES) or (
                mod.__name__ in ("test_examples", "test_integrations", "test_library_alone",
                                 "test_netlink", "test_launch", "test_cli")):
            item.add_marker(pytest.mark.distributed)
        else:
            item.add_marker(pytest.mark.unit)
