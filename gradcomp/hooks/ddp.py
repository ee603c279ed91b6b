"""The DDP adapter: ``hook(state, bucket)`` and the one-line ``register``."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..compressors import METHODS
from . import fsdp
from . import optimizer as optimizer_binding
from .agree import agree, discard, fingerprint, trainable
from .local import check_local
from .state import GradcompState
from .topology import node_size

MAX_LANES = 32


def hook(state: GradcompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: queue the bucket's exchange, return its future at once."""
    return state.submit(bucket.index(), bucket.buffer(), bucket.parameters(), bucket.is_last())


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"name:key=value,key=value"`` -> (name, {key: value}) with values typed per option;
    a key given twice is refused."""
    if not isinstance(spec, str):
        raise TypeError(f"method must be a name or spec string such as 'onebit' or "
                        f"'powersgd:rank=4', got {spec!r}: allowed {', '.join(sorted(METHODS))}")
    name, _, rest = spec.strip().partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}: allowed {', '.join(sorted(METHODS))}")
    cfg = METHODS[name].config
    opts = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"bad option {item!r} in {spec!r}: expected key=value")
        key = key.strip()
        if key not in cfg.options():
            raise ValueError(f"unknown option {key!r} for {name}: allowed {', '.join(cfg.options())}")
        if key in opts:
            raise ValueError(f"option {key!r} given twice in {spec!r}: give each option once")
        opts[key] = cfg.parse_value(key, value.strip())
    return name, opts


def merge_options(method: str, options: dict) -> tuple[str, dict]:
    """(name, the spec's options + ``options``); an option given in both is an error."""
    name, opts = parse_spec(method)
    clash = sorted(set(opts) & set(options))
    if clash:
        raise ValueError(f"option(s) {', '.join(clash)} given both in {method!r} and as arguments")
    return name, {**opts, **options}


def build_config(method: str, **options):
    """The validated config of ``method`` (a name or spec string) with ``options``."""
    name, opts = merge_options(method, options)
    return name, METHODS[name].config.from_dict(opts)


def methods() -> list[dict]:
    """Every method with its description and options {name: (type, default)}."""
    return [{"name": s.name, "description": s.description, "options": s.config.options()}
            for s in METHODS.values()]


def register(model: DistributedDataParallel, method: str, *, optimizer=None, scaler=None,
             lanes: int = 4, process_group=None, log_dir=None, log_all_ranks=False,
             log_details=False, **options) -> GradcompState:
    """Register a gradcomp communication hook on a DDP model and return its state.

    ``method`` is a name or spec (``"powersgd:rank=2"``); ``options`` are the method's
    options (``gradcomp.methods()`` lists them). ``optimizer`` is required for ``dgc``, which
    applies the optimizer's momentum and weight decay in the hook, read from its param groups
    at every step (schedulers that cycle momentum are followed), and keeps the optimizer from
    applying them again (zero only while ``optimizer.step()`` runs). ``scaler``: the ``torch.amp.GradScaler`` of an fp16
    job, whose loss scale the gradients carry; the hook keeps its memory unscaled so that
    scale changes do not corrupt it (not with ``delay``: a rank's overflow would reach the
    others only D steps later). With ``local_steps`` > 1 ``optimizer`` is required: the
    outer step runs from its step post-hook every ``local_steps`` steps (hooks/local.py).
    ``log_dir``: TensorBoard scalars per step (rank 0
    only unless ``log_all_ranks``; ``log_details`` adds costly diagnostics such as PowerSGD's
    approximation error: see :meth:`GradcompState.attach`). Must be called on every rank (it is collective):
    ranks that registered different methods or options all raise ValueError.

    Example::

        model = DistributedDataParallel(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = gradcomp.register(model, "dgc", ratio=0.001, optimizer=opt)
    """
    sharded = fsdp.is_fsdp(model)
    if not sharded and not isinstance(model, DistributedDataParallel):
        raise TypeError(f"register() needs a torch.nn.parallel.DistributedDataParallel model or "
                        f"a model sharded with torch.distributed.fsdp.fully_shard, "
                        f"got {type(model).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("gradcomp.register needs torch.distributed initialized (it is not, or "
                           "destroy_process_group() was called): call "
                           "torch.distributed.init_process_group() first, on every rank")
    if sharded:  # sharded with fully_shard: hooks/fsdp.py
        if process_group is not None:
            raise ValueError("process_group= with an FSDP model: allowed None (the groups "
                             "come from the model's device mesh)")
        return fsdp.register(model, method, optimizer=optimizer, scaler=scaler, lanes=lanes,
                             log_dir=log_dir, log_all_ranks=log_all_ranks,
                             log_details=log_details, **options)
    pg = process_group if process_group is not None else model.process_group
    try:
        ranks = dist.get_process_group_ranks(pg)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise RuntimeError(f"gradcomp.register: the model's process group is not a live group "
                           f"of this job ({type(exc).__name__}); wrap the model in DDP after "
                           f"init_process_group() and register it in the same job") from None
    # A group of our own: DDP issues collectives of its own on its group (unused-parameter
    # maps, bucket rebuilds) that must not interleave with our exchanges.
    backend = dist.get_backend(pg)
    made = []  # every group created here: the state destroys them at close()

    def new_group(members):
        g = dist.new_group(ranks=members, backend=backend)
        made.append(g)
        return g

    group = new_group(ranks)

    def build():
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
            raise ValueError(f"invalid lanes={lanes!r}: allowed an integer in [1, {MAX_LANES}] "
                             f"(each lane is a process group and a thread)")
        _check_compiled_autograd(model)
        state = _build_state(model, method, optimizer, group, options)
        if scaler is not None:
            if state.config.delay:
                raise ValueError(f"scaler= with delay={state.config.delay}: a GradScaler skips a "
                                 f"step on the rank that overflowed, and with delay the others "
                                 f"learn of it only {state.config.delay} steps later; use "
                                 f"delay=0, or bfloat16 without a scaler")
            state.scaler = scaler
        check_local(state, optimizer, scaler)
        local = node_size(state.config, len(ranks))
        return state, {"method": state.method, **state.config.to_dict(), "lanes": lanes,
                       "ranks per node": local, **fingerprint(model.module, optimizer, scaler)}

    # Validate locally, then compare with every rank before raising anything, so a rank whose
    # options are bad cannot leave the others waiting in a collective.
    state, mine = agree(group, ranks, build, lambda st: discard(st, made))
    local = mine["ranks per node"]
    # every rank agreed on `lanes`: each creates the same groups in the same order
    state._owned_groups = made
    me = ranks.index(dist.get_rank())

    def node_pair():  # this rank's node group and its group across nodes (collective)
        nodes = [new_group(ranks[n : n + local]) for n in range(0, len(ranks), local)]
        across = [new_group(ranks[j::local]) for j in range(local)]
        return nodes[me // local], across[me % local]

    pairs = []
    if local and state.config.topology == "auto":  # hierarchical only where it is faster
        pairs.append(node_pair())
        local = _probe_topology(model, state, group, pairs[0], local)
    state.add_lanes([new_group(ranks) for _ in range(lanes - 1)])
    if local:  # ... and the same node and cross-node groups, one pair per lane
        pairs += [node_pair() for _ in range(lanes - len(pairs))]
        state.set_topology(local, pairs)
    model.register_comm_hook(state, hook)
    # only once every rank agreed: nothing attached on a refusal
    optimizer_binding.bind(state, optimizer, module=model.module,
                           bucket_bytes=getattr(model, "bucket_bytes_cap", None),
                           warn=dist.get_rank(group) == 0)
    if log_dir is not None and (log_all_ranks or dist.get_rank(group) == 0):
        from torch.utils.tensorboard import SummaryWriter
        state.attach(SummaryWriter(log_dir), details=log_details)
    return state


def _probe_topology(model, state, group, pair, local) -> int:
    """topology=auto on several nodes: time one bucket's exchange of the method both ways
    (hooks/topology.py) and keep hierarchical only where it was faster; the ranks per node
    chosen (0: flat). What was measured goes in ``state.topology_probe`` (and ``stats()``)."""
    from dataclasses import replace

    from .topology import PROBE_MAX_BYTES, probe_bucket, probe_times

    cfg = replace(state.config, warmup="none", dense_steps=None, adam="off", delay=0,
                  local_steps=1, topology="flat")
    named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
    cap = min(getattr(model, "bucket_bytes_cap", PROBE_MAX_BYTES) or PROBE_MAX_BYTES,
              PROBE_MAX_BYTES)
    params = probe_bucket(named, cap)

    def make_state():
        return GradcompState(state.method, cfg, group=group,
                             param_names=dict(state._param_names),
                             param_numels=dict(state._param_numels))

    flat, hier = probe_times(make_state, params, group, [pair], local)
    chosen = local if hier < flat else 0
    state.topology_probe = {"flat_s": flat, "hierarchical_s": hier,
                            "chosen": "hierarchical" if chosen else "flat",
                            "ranks_per_node": local, "bucket_bytes": 4 * (
                                params[-1].offset + params[-1].numel)}
    return chosen


def _check_compiled_autograd(model) -> None:
    """Compiled autograd runs DDP's Python reducer (``optimize_ddp="python_reducer"``), which
    does not call a comm hook as the C++ reducer does: refused, naming what works."""
    import torch._dynamo

    python_reducer = getattr(model, "_use_python_reducer", False)
    if python_reducer or torch._dynamo.config.compiled_autograd:
        what = ("DDP built with torch._dynamo.config.optimize_ddp='python_reducer'"
                if python_reducer else "torch._dynamo.config.compiled_autograd=True")
        raise ValueError(f"{what}: compiled autograd's DDP reducer runs no communication "
                         f"hook, so gradcomp cannot compress its gradients; allowed "
                         f"compiled_autograd=False and optimize_ddp left at its default "
                         f"('ddp_optimizer'), with which torch.compile(ddp_model) compiles "
                         f"the forward and backward and the hook runs as in eager")


def _build_state(model, method, optimizer, group, options) -> GradcompState:
    name, options = merge_options(method, options)
    # what the method needs from the optimizer (DGC: its momentum) is the method's business
    config = METHODS[name].config.from_dict(METHODS[name].compressor.prepare(options, optimizer))
    _check_adam(name, config, optimizer)
    for mname, mod in model.module.named_modules():
        if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and mod.sparse:
            raise ValueError(f"module {mname!r} is {type(mod).__name__}(sparse=True): its "
                             f"sparse gradients cannot go through a DDP comm hook's flat "
                             f"bucket; allowed sparse=False (dense gradients, compressed as "
                             f"any other)")
    names, numels = trainable(model.module)
    return GradcompState(name, config, group=group, param_names=names, param_numels=numels)


def _check_adam(name, config, optimizer) -> None:
    """``adam``: what the frozen-variance Adam step (hooks/optimizer.py) needs."""
    if METHODS[name].compressor.stateless or config.adam == "off":
        return
    adam = optimizer is not None and optimizer_binding.is_adam(optimizer)
    if config.adam in ("freeze", "precondition") and not adam:
        raise ValueError(f"adam={config.adam!r} needs optimizer=torch.optim.Adam or AdamW, got "
                         f"{type(optimizer).__name__}: allowed adam='auto' or 'off' here")
    if not adam:
        return
    if config.local_steps > 1:
        if config.adam != "auto":
            raise ValueError(f"adam={config.adam!r} with local_steps={config.local_steps}: the inner "
                             f"steps are Adam's own and the pseudo-gradient goes through the "
                             f"method; allowed adam='auto' or 'off'")
        return
    optimizer_binding.check_adam(optimizer)
    if config.dense_steps == 0 or (config.dense_steps is None and config.warmup_rule == "none"):
        raise ValueError(f"{name} with {type(optimizer_binding.unwrap(optimizer)).__name__}: "
                         f"Adam's second moment is learned during dense warm-up steps and "
                         f"frozen once compression starts (adam='freeze'), and this job has "
                         f"none (dense_steps=0 or warmup='none'); allowed: the adaptive "
                         f"warm-up (the default), dense_steps=N > 0, or adam='off' (Adam then "
                         f"sees compressed gradients: measured to lose accuracy)")
