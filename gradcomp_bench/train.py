"""A short, readable DDP training loop on CIFAR-10, used by the example job, the
convergence tests and the benchmark CLI. One call = one rank."""
from __future__ import annotations

import math
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from . import data, models, peers
from gradcomp.hooks import build_config, parse_spec, register

# Baselines that are not gradcomp methods: torch's own hooks, no communication at all
# (``noop``), and ``sync``: no gradient sent, but the ranks meet once per bucket as every
# method's exchange makes them (a one-element allreduce): compute-only plus the wait for the
# slower rank. Each with its options and their defaults (all integers, >= 1 unless named in
# _MIN_ZERO).
# torch-powersgd's ``ordered=1`` completes each bucket's exchange inside the hook (see
# _in_order): the same arithmetic, issued in one order on every rank.
BASELINES = {"ddp": {}, "fp16": {}, "torch-powersgd": {"rank": 2, "start": 2, "ordered": 0},
             "noop": {}, "sync": {}}
_MIN_ZERO = {"ordered"}


ORDERED = "|ordered"  # a gradcomp spec's suffix: its collectives in NCCL's global order


def split_ordered(spec: str) -> tuple[str, bool]:
    """(the spec without ``|ordered``, whether it had it). ``onebit|ordered`` sets
    ``state.ordered = True`` after registering (on gloo the default is False: the rig
    compares the two side by side)."""
    spec = spec.strip()
    return (spec[: -len(ORDERED)], True) if spec.endswith(ORDERED) else (spec, False)


def parse_method(spec: str) -> tuple[str, dict]:
    """A method spec, ``"name:key=value,..."``, as (name, options): a gradcomp method's by the
    library's own :func:`gradcomp.parse_spec` (and checked by its config), a baseline's with
    its defaults filled in. ValueError names what is wrong."""
    spec, ordered = split_ordered(spec)
    if peers.is_peer(spec) and not ordered:  # another library's method (peers.py)
        return peers.parse(spec)
    if ordered and not is_gradcomp(spec):
        raise ValueError(f"{spec + ORDERED!r}: {ORDERED} is for gradcomp's methods")
    name, _, rest = spec.strip().partition(":")
    if name == "auto":  # the library picks the method at registration (hooks/auto.py)
        return parse_spec(spec, auto=True)
    if name not in BASELINES:
        build_config(spec)  # the option values too, not only their names
        return parse_spec(spec)
    opts = dict(BASELINES[name])
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = (p.strip() for p in item.partition("="))
        if not eq or key not in opts:
            allowed = ", ".join(f"{k}=N" for k in opts) or "none"
            raise ValueError(f"bad option {item!r} for {name}: allowed {allowed}")
        try:
            opts[key] = int(value)
        except ValueError:
            raise ValueError(f"bad option {item!r} for {name}: expected an integer") from None
        low = 0 if key in _MIN_ZERO else 1
        if opts[key] < low:
            raise ValueError(f"bad option {item!r} for {name}: expected an integer >= {low}")
    return name, opts


def is_gradcomp(spec: str) -> bool:
    spec = split_ordered(spec)[0]
    return spec.partition(":")[0] not in BASELINES and not peers.is_peer(spec)


def _in_order(hook):
    """``hook`` with its future completed before it returns. torch's PowerSGD hook issues its
    P and Q allreduces from the callbacks of earlier futures; on gloo those run on gloo's
    threads, so with more than one bucket two ranks can issue them in different orders and
    gloo aborts ("op.preamble.length <= op.nbytes ... collective mismatch"; reproduced by
    bench/torch_powersgd_gloo.py). Waiting here keeps every collective in bucket order."""
    def ordered(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut
    return ordered


def _noop_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class SyncState:
    """The ``sync`` baseline's state: how many bucket meetings there were, and the sum of
    what their allreduces of a one gave (the number of ranks that reached each; a tensor on
    the buckets' device, so no host sync)."""

    def __init__(self):
        self.meetings = 0
        self.ranks_total = None
        # the callbacks run on the backend's threads, two buckets' at once on gloo's pool
        self.lock = threading.Lock()


def _sync_hook(state: SyncState, bucket):
    buf = bucket.buffer()
    fut = dist.all_reduce(buf.new_ones(1), async_op=True).get_future()

    def done(f):
        got = f.value()[0]
        with state.lock:
            state.meetings += 1
            state.ranks_total = got if state.ranks_total is None else state.ranks_total + got
        return buf  # the rank's own gradient, not averaged (as noop's)
    return fut.then(done)


def attach(model: DDP, spec: str, optimizer, **options):
    """Put ``spec``'s communication on ``model``; returns the gradcomp state or None."""
    if is_gradcomp(spec):
        spec, ordered = split_ordered(spec)
        state = register(model, spec, optimizer=optimizer, **options)
        if ordered:
            state.ordered = True
        return state
    name, opts = parse_method(spec)
    if name == "ddp":
        return None
    if not isinstance(model, DDP):
        raise ValueError(f"baseline {name!r} is a DDP comm hook: allowed with a sharded model "
                         f"are 'ddp' (plain FSDP/HSDP) and gradcomp's methods")
    if name == "noop":
        model.register_comm_hook(None, _noop_hook)
        return None
    if name == "sync":
        model.register_comm_hook(SyncState(), _sync_hook)
        return None
    if name == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if name == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=opts["rank"],
                                 start_powerSGD_iter=opts["start"], use_error_feedback=True,
                                 warm_start=True)
        model.register_comm_hook(state, _in_order(ps.powerSGD_hook) if opts["ordered"]
                                 else ps.powerSGD_hook)
        return None
    raise AssertionError(f"baseline {name} has no attach")  # BASELINES and attach disagree


@dataclass
class TrainConfig:
    method: str = "allreduce"
    model: str = "resnet_small"
    data: str | None = None          # CIFAR python-layout directory; None: defaults
    synthetic: bool = False          # use synthetic data instead of CIFAR
    epochs: float = 1.0
    max_steps: int = 0               # stop after this many steps (0: epochs decide)
    batch: int = 32                  # per rank
    lr: float = 0.05                 # per 32 images per rank x world
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup_epochs: float = 0.5
    # "cosine": linear warm-up then cosine (LambdaLR); "onecycle": torch's OneCycleLR, which
    # also cycles the optimizer's momentum (0.85-0.95) every step, as many user jobs do
    schedule: str = "cosine"
    seed: int = 0
    augment: bool = True
    eval: bool = True
    train_subset: int = 0            # use only the first N training images (0: all)
    options: dict = field(default_factory=dict)  # extra gradcomp options (e.g. delay)
    # DDP's per-forward broadcast of BatchNorm buffers is a blocking round trip that no comm
    # hook can hide; off, each rank keeps its own running statistics (rank 0's are evaluated).
    broadcast_buffers: bool = False
    barrier: bool = False            # a dist.barrier() after each step, as many user loops do
    # "auto": a GPU per rank under NCCL, else the CPU; "cuda": a GPU per rank whatever the
    # backend (several gloo ranks may share one GPU); "cpu"
    device: str = "auto"
    # language models (models.LANGUAGE_MODELS): AdamW on the character corpus (train_lm)
    optimizer: str = "auto"          # "sgd", "adamw"; "auto": adamw for language models
    betas: tuple = (0.9, 0.95)
    clip: float = 1.0                # gradient clipping (language models; 0 = off)
    clip_steps: int = 0              # clip only in the first N steps (0: every step)
    bf16: bool = False               # bf16 autocast of the forward (language models)
    seq_len: int = 0                 # language models: characters per window; 0: the model's context
    warmup_steps: int = 0            # language models: linear warm-up (0: 5% of the steps)
    eval_every: int = 0              # language models: validation every N steps (0: 10 times)
    # language models: "ddp"; "fsdp": fully_shard on a 1-D mesh (each block, then the root);
    # "hsdp": a 2-D mesh, shards inside a node of ranks_per_node ranks, replicas across nodes
    parallel: str = "ddp"
    ranks_per_node: int = 0          # hsdp: ranks per node (0: LOCAL_WORLD_SIZE)


def train(rank: int, world: int, cfg: TrainConfig | dict) -> dict:
    """Train on this rank; returns losses, accuracy, step times and bytes (rank's view)."""
    cfg = TrainConfig(**cfg) if isinstance(cfg, dict) else cfg
    if cfg.model in models.LANGUAGE_MODELS:
        return train_lm(rank, world, cfg)
    if peers.is_peer(cfg.method):
        raise ValueError(f"{cfg.method!r}: peers run on the language models "
                         f"({', '.join(models.LANGUAGE_MODELS)})")
    torch.manual_seed(cfg.seed)
    if cfg.synthetic:
        (xtr, ytr), (xte, yte) = data.synthetic(seed=cfg.seed)
    else:
        (xtr, ytr), (xte, yte) = data.load(data.resolve(cfg.data))
    if cfg.train_subset:
        xtr, ytr = xtr[: cfg.train_subset], ytr[: cfg.train_subset]
    device = _device(cfg, rank)
    net = models.build(cfg.model).to(device)
    model = _ddp(net, cfg, device)
    if cfg.optimizer in ("auto", "sgd"):
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr * world, momentum=cfg.momentum,
                              weight_decay=cfg.weight_decay, nesterov=cfg.momentum > 0)
    elif cfg.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas),
                                weight_decay=cfg.weight_decay)
    else:
        raise ValueError(f"optimizer={cfg.optimizer!r}: allowed 'auto', 'adamw', 'sgd'")
    state = attach(model, cfg.method, opt, **cfg.options)
    per_rank = len(xtr) // world
    steps_per_epoch = max(1, per_rank // cfg.batch)
    total = math.ceil(cfg.epochs * steps_per_epoch)
    if cfg.max_steps:
        total = min(total, cfg.max_steps) if cfg.epochs else cfg.max_steps
    warm = max(1, int(cfg.warmup_epochs * steps_per_epoch))
    if cfg.schedule == "onecycle":  # created after register, as a user's job would
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr * world, total_steps=total)
    elif cfg.schedule == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))
    else:
        raise ValueError(f"schedule={cfg.schedule!r}: allowed 'cosine', 'onecycle'")
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    losses, times, cpu, curve, hist, phases, step = [], [], [], [], [], [], 0
    model.train()
    while step < total:
        perm = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(cfg.seed + step))
        mine = perm[rank::world][: steps_per_epoch * cfg.batch]
        for b in range(steps_per_epoch):
            if step >= total:
                break
            idx = mine[b * cfg.batch : (b + 1) * cfg.batch]
            xb = xtr[idx]
            if cfg.augment:
                xb = data.augment(xb, gen)
            xb, yb = data.normalize(xb).to(device), ytr[idx].to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            traced = getattr(state, "trace", False) is None  # a gradcomp.State: its timestamps
            if traced:
                state.trace = []
            t0, c0 = time.perf_counter(), time.process_time()
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            sched.step()
            if cfg.barrier:
                dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            phases.append(_phases(t0, t1, t2, times[-1], state.trace if traced else None))
            if traced:
                state.trace = None
            losses.append(loss.item())
            if state is not None:
                hist.append(state.stats())
            step += 1
        if cfg.eval:
            curve.append({"step": step, **evaluate(net, xte, yte, device),
                          "train_loss": sum(losses[-steps_per_epoch:]) / len(losses[-steps_per_epoch:])})
    if state is not None and hasattr(state, "flush"):
        state.flush()
    out = {"config": asdict(cfg), "losses": losses, "step_times": times,
           # the rank's CPU seconds per step: on a CPU rank, how much of a core it was given
           "cpu_times": cpu if device.type == "cpu" else None,
           "curve": curve, "world": world, "steps": step, "phases": phases,
           "bucket_bytes": _bucket_bytes(model)}
    if state is not None:
        out["stats"] = state.stats()
        out["stats_history"] = hist
        state.close()
    if cfg.eval:
        out.update(curve[-1])
    return out


def _bucket_bytes(model) -> list[int] | None:
    """The bytes of each of DDP's buckets as it last built them (by the order backward made
    the gradients ready, after its first step), bucket 0 first; None where it does not say
    (not DDP)."""
    try:
        return [b.buffer().numel() * b.buffer().element_size()
                for b in model.reducer._get_zeros_like_grad_buckets()]
    except (AttributeError, RuntimeError):
        return None


def _phases(t0: float, t1: float, t2: float, step_s: float, trace) -> dict:
    """One step's split: forward (and zero_grad), backward (which returns once every bucket's
    exchange has finished: DDP waits for them), the rest (optimizer, scheduler); with a
    gradcomp state's ``trace``, ``tail_s``: from the last bucket handed to the hook to
    backward's return, the part of the exchanges that no gradient computation hid."""
    out = {"forward_s": t1 - t0, "backward_s": t2 - t1, "rest_s": step_s - (t2 - t0)}
    submits = [e[2] for e in trace or () if e[0] == "submit"]
    if submits:
        out["tail_s"] = max(0.0, t2 - max(submits))
        # each event (submit / exchange, bucket, start, end), in seconds from backward's start
        out["events"] = [(k, b, a - t1, z - t1) for k, b, a, z in trace]
    return out


def _device(cfg: TrainConfig, rank: int) -> torch.device:
    if cfg.device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device={cfg.device!r}: allowed 'auto', 'cuda', 'cpu'")
    device = torch.device("cpu")
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()
                                and dist.get_backend() == "nccl"):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    return device


def _ddp(net, cfg: TrainConfig, device) -> DDP:
    with warnings.catch_warnings():
        # torch >= 2.13 deprecates broadcast_buffers for forward_sync_buffers; the old spelling
        # still means exactly what is asked for here (no per-forward buffer broadcast)
        warnings.filterwarnings("ignore", message=".*broadcast_buffers", category=FutureWarning)
        return DDP(net, broadcast_buffers=cfg.broadcast_buffers,
                   device_ids=[device.index] if device.type == "cuda" else None)


def _shard(net, cfg: TrainConfig, world: int, device):
    """FSDP2 (``fully_shard``): each block, then the root; ``hsdp``: a (nodes, ranks per
    node) mesh, replicated across nodes; bf16 parameters with fp32 reduction under ``bf16``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if cfg.parallel == "hsdp":
        L = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
        if not (1 < L < world and world % L == 0):
            raise ValueError(f"parallel='hsdp' with {L} ranks per node in a world of {world}: "
                             f"allowed a divisor of the world between 2 and world/2")
        mesh = init_device_mesh(device.type, (world // L, L), mesh_dim_names=("replicate", "shard"))
    elif cfg.parallel == "fsdp":
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    else:
        raise ValueError(f"parallel={cfg.parallel!r}: allowed 'ddp', 'fsdp', 'hsdp'")
    kw = {"mesh": mesh}
    if cfg.bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for block in net.blocks:
        fully_shard(block, **kw)
    return fully_shard(net, **kw)


def lm_schedule(opt, total: int, warm: int):
    """The language models' learning-rate schedule: linear warm-up over ``warm`` steps, then
    cosine to 10% at ``total``."""
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm,
                           0.1 + 0.45 * (1 + math.cos(math.pi * min(s, total) / total))))


def train_lm(rank: int, world: int, cfg: TrainConfig) -> dict:
    """A GPT on the character corpus, as a transformer user trains it: AdamW (decay on the
    weight matrices only), linear warm-up then cosine to 10%, gradient clipping, optional
    bf16 autocast; ``max_steps`` steps of ``batch`` windows of ``seq_len`` characters per
    rank. Reports validation loss (nats per character) on fixed windows of the held-out
    last 10% of the corpus."""
    torch.manual_seed(cfg.seed)
    train_codes, val_codes = (data.synthetic_text(seed=cfg.seed) if cfg.synthetic
                              else data.load_text(cfg.data))
    device = _device(cfg, rank)
    net = models.build(cfg.model).to(device)
    peer = peers.is_peer(cfg.method)
    if peer and cfg.parallel != "ddp":
        raise ValueError(f"{cfg.method!r} with parallel={cfg.parallel!r}: a peer runs each "
                         f"rank as its own replica; allowed parallel='ddp'")
    # a peer's replicas step on their own gradients: no DDP
    model = (net if peer else _ddp(net, cfg, device) if cfg.parallel == "ddp"
             else _shard(net, cfg, world, device))
    opt_name = "adamw" if cfg.optimizer == "auto" else cfg.optimizer
    if opt_name == "adamw":
        opt = torch.optim.AdamW(models.decay_groups(net, cfg.weight_decay), lr=cfg.lr,
                                betas=tuple(cfg.betas))
    elif opt_name == "sgd":
        opt = torch.optim.SGD(models.decay_groups(net, cfg.weight_decay), lr=cfg.lr,
                              momentum=cfg.momentum)
    else:
        raise ValueError(f"optimizer={cfg.optimizer!r}: allowed 'auto', 'adamw', 'sgd'")
    state = (peers.attach(net, cfg.method, opt, rank, world) if peer
             else attach(model, cfg.method, opt, **cfg.options))
    total = cfg.max_steps or 1000
    sched = lm_schedule(opt, total, cfg.warmup_steps or max(1, total // 20))
    T = cfg.seq_len or net.context
    if not 1 <= T <= net.context:
        raise ValueError(f"seq_len={cfg.seq_len}: allowed 1 to {net.context}, the context of "
                         f"model {cfg.model!r}")
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    val_starts = torch.linspace(0, len(val_codes) - T - 2, 128).long()
    every = cfg.eval_every or max(1, total // 10)
    losses, times, cpu, curve, hist, norms = [], [], [], [], [], []
    model.train()
    for step in range(total):
        starts = torch.randint(0, len(train_codes) - T - 1, (cfg.batch,), generator=gen)
        xb, yb = (t.to(device) for t in data.windows(train_codes, starts, T))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = model(xb)
        loss = F.cross_entropy(logits.float().flatten(0, 1), yb.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.clip and (not cfg.clip_steps or step < cfg.clip_steps):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(loss.item())
        if state is not None:
            hist.append(state.stats())
        if (step + 1) % every == 0 or step + 1 == total:
            curve.append({"step": step + 1, "val_loss": evaluate_lm(net, val_codes, val_starts,
                                                                     T, device, cfg.bf16),
                          "train_loss": sum(losses[-every:]) / len(losses[-every:])})
    if state is not None and hasattr(state, "flush"):
        state.flush()
    out = {"config": asdict(cfg), "losses": losses, "step_times": times,
           # the rank's CPU seconds per step: on a CPU rank, how much of a core it was given
           "cpu_times": cpu if device.type == "cpu" else None,
           "curve": curve, "world": world, "steps": total, "grad_norms": norms, **curve[-1]}
    if state is not None:
        out["stats"] = state.stats()
        out["stats_history"] = hist
        state.close()
    return out


@torch.no_grad()
def evaluate_lm(net, codes, starts, T, device, bf16=False, batch=64) -> float:
    """Mean next-character cross-entropy (nats) over the windows at ``starts``."""
    was = net.training
    net.eval()
    total = 0.0
    for i in range(0, len(starts), batch):
        x, y = (t.to(device) for t in data.windows(codes, starts[i : i + batch], T))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = net(x)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
    net.train(was)
    return total / (len(starts) * T)


@torch.no_grad()
def evaluate(net, x, y, device=torch.device("cpu"), batch=500) -> dict:
    was = net.training
    net.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(x), batch):
        yb = y[i : i + batch].to(device)
        logits = net(data.normalize(x[i : i + batch]).to(device))
        loss += F.cross_entropy(logits, yb, reduction="sum").item()
        correct += (logits.argmax(1) == yb).sum().item()
    net.train(was)
    return {"test_acc": correct / len(x), "test_loss": loss / len(x)}
