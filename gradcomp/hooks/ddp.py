"""The DDP adapter: ``hook(state, bucket)`` and ``register_ddp`` for a DDP model (the public
``gradcomp.register`` is hooks/register.py, which dispatches here or to fsdp.py)."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import optimizer as optimizer_binding
from .agree import Groups, agree, check_log_dir, discard, fingerprint, trainable
from .checkpoint import load_group
from .. import rules
from .local_steps import check_fragments, check_outer_optimizer
from .options import for_optimizer, is_auto, merge_options
from .plan import Plan
from .public import State, state_of
from .state import HookState
from .topology import node_size

MAX_LANES = 32
LANES = 4  # the default: process groups (and threads) exchanging buckets side by side


def hook(state: State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: queue the bucket's exchange, return its future at once."""
    buf = bucket.buffer()
    fut = state_of(state).entries.bucket(bucket.index(), buf, bucket.parameters(), bucket.is_last())
    return fut.then(lambda f: _result(f, buf))


def _result(fut, buf):
    """The exchange's average, or where the exchange raised, its error for DDP to raise. DDP
    reads a hook's future from C++: an exception set on a Python future reaches the user as
    "Unable to cast <message> to Tensor". On the CPU ``buf`` comes back as a tensor that
    raises the error at DDP's first use of it: backward then raises it as itself (its type
    and message). On a GPU DDP reads the result on an autograd device thread, where a Python
    error raised there is lost (a SystemError, and a stale error on that thread): raised
    here, in the future's callback, it reaches the user as a RuntimeError that quotes it
    ("Got the following error when running the callback: <type>: <message>")."""
    try:
        return fut.value()
    except Exception as exc:  # noqa: BLE001  (the exchange's own error, handed on as it is)
        if buf.device.type != "cpu":
            raise
        out = buf.as_subclass(_Failed)
        out.error = exc
        return out


class _Failed(torch.Tensor):
    """A bucket whose exchange failed: every operation on it raises the exchange's error."""

    error: BaseException

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        for a in (*args, *(kwargs or {}).values()):
            if isinstance(a, _Failed):
                raise a.error
        return NotImplemented


def check_group(model: DistributedDataParallel, process_group) -> list:
    """The ranks of the DDP model's process group; ``process_group=``, if given, must hold
    the same ranks (DDP averages over its own group's ranks, so the exchange must too)."""
    try:
        ranks = dist.get_process_group_ranks(model.process_group)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise RuntimeError(f"gradcomp.register: the model's process group is not a live group "
                           f"of this job ({type(exc).__name__}); wrap the model in DDP after "
                           f"init_process_group() and register it in the same job") from None
    if process_group is not None:
        try:
            given = dist.get_process_group_ranks(process_group)
        except (KeyError, ValueError, RuntimeError, TypeError, AttributeError):
            given = None  # not a group this rank is in
        if given != ranks:
            raise ValueError(f"process_group= holds ranks {given if given is not None else 'without this rank'}"
                             f", the DDP model's group {ranks}: DDP averages over its own "
                             f"group's ranks, so the exchange must too; allowed a group of "
                             f"the same ranks, or None (the model's)")
    return ranks


def register_ddp(model: DistributedDataParallel, method: str, *, optimizer=None, scaler=None,
             lanes: int = LANES, process_group=None, log_dir=None, log_all_ranks=False,
             log_details=False, outer_optimizer=None, **options) -> HookState:
    """``gradcomp.register`` for a DDP model (hooks/register.py checked the model, the
    process group and ``lanes``): validate and agree, the process groups, the state built
    once from its plan (hooks/plan.py), the hook, then the optimizer."""
    ranks = check_group(model, process_group)  # (register checked it on every rank first)
    pg = process_group if process_group is not None else model.process_group
    # A group of our own: DDP issues collectives of its own on its group (unused-parameter
    # maps, bucket rebuilds) that must not interleave with our exchanges.
    groups = Groups(dist.get_backend(pg))
    group = groups.new(ranks)
    probe = None
    if is_auto(method):  # the fastest method that holds, measured on this link
        method, options, probe = _choose_method(model, method, optimizer, group, ranks,
                                                options, groups.made, scaler)
    writes = log_all_ranks or dist.get_rank(group) == 0
    (name, config), mine = agree(
        group, ranks, lambda: _validate(model, method, optimizer, scaler, lanes, writes, log_dir,
                                        len(ranks), options, outer_optimizer),
        lambda _: discard(groups.made))
    with groups.undone_on_error():
        plan = _plan(model, name, config, group, ranks, groups, lanes, mine["ranks per node"],
                     scaler, probe)
        state = HookState(name, config, group=group, plan=plan, **_named(model.module))
    model.register_comm_hook(state, hook)
    # only once every rank agreed: nothing attached on a refusal
    state.bind_optimizer(optimizer, module=model.module,
                         bucket_bytes=getattr(model, "bucket_bytes_cap", None),
                         warn=dist.get_rank(group) == 0, outer_optimizer=outer_optimizer)
    if log_dir is not None and writes:
        from torch.utils.tensorboard import SummaryWriter
        State(state).attach(SummaryWriter(log_dir), details=log_details)
    return state


def _hook_owner(fn, hook_state) -> str:
    """Whose communication hook a DDP model holds, in words."""
    if isinstance(hook_state, (State, HookState)):
        return (f"gradcomp's, registered with method {hook_state.method!r} (gradcomp.register "
                f"was called on this model before)")
    where = ".".join(filter(None, (getattr(fn, "__module__", None),
                                   getattr(fn, "__qualname__", None) or repr(fn))))
    return f"{where} (registered with model.register_comm_hook)"


def _validate(model, method, optimizer, scaler, lanes, writes, log_dir, world, options,
              outer_optimizer=None):
    """Registration's checks on this rank (agree() compares the result on every rank):
    (method, config), and what must be equal everywhere."""
    _check_compiled_autograd(model)
    if getattr(model, "_comm_hooks", None):
        raise ValueError(f"this DDP model already has a communication hook: "
                         f"{_hook_owner(*model._comm_hooks[0][:2])}. DDP takes one hook "
                         f"per model and keeps it (state.close() does not remove it): "
                         f"register gradcomp once per DDP model, or wrap the module in a "
                         f"new DistributedDataParallel to change the method")
    check_log_dir(log_dir, writes)  # before anything is attached
    name, config = _method_config(model, method, optimizer, options)
    rules.check(config, rules.Job.given(rules.DDP, optimizer, scaler, outer_optimizer))
    check_outer_optimizer(outer_optimizer)
    check_fragments(config, [p.numel() for p in model.module.parameters() if p.requires_grad])
    local = node_size(config, world)
    return (name, config), {"method": name, **config.to_dict(), "lanes": lanes,
                            "ranks per node": local,
                            **fingerprint(model.module, optimizer, scaler)}


def _plan(model, name, config, group, ranks, groups, lanes, local, scaler, probe) -> Plan:
    """After the agreement, on every rank alike: the loads' group, the topology (measured
    where ``auto``), a process group per lane."""
    loads = load_group(ranks, groups.made)
    me = ranks.index(dist.get_rank())

    def node_pair():  # this rank's node group and its group across nodes (collective)
        nodes = [groups.new(ranks[n : n + local]) for n in range(0, len(ranks), local)]
        across = [groups.new(ranks[j::local]) for j in range(local)]
        return nodes[me // local], across[me % local]

    pairs, measured = [], None
    if local and config.topology == "auto":  # hierarchical only where it is faster
        first = len(groups.made)
        pairs.append(node_pair())
        local, measured = _probe_topology(model, name, config, group, pairs[0], local)
        if not local:  # flat: the probe's node groups are not kept open until close()
            groups.destroy_from(first)
            pairs.clear()
    lane_groups = tuple(groups.new(ranks) for _ in range(lanes - 1))
    if local:  # ... and the same node and cross-node groups, one pair per lane
        pairs += [node_pair() for _ in range(lanes - len(pairs))]
    return Plan(scaler=scaler, lane_groups=lane_groups,
                topology=(local, pairs) if local else None, owned_groups=tuple(groups.made),
                load_group=loads, topology_probe=measured, method_probe=probe)


def _named(module) -> dict:
    """The state's ``param_names`` and ``param_numels`` of a module's trainable parameters."""
    names, numels = trainable(module)
    return {"param_names": names, "param_numels": numels}


def _probe_topology(model, name, config, group, pair, local):
    """topology=auto on several nodes: time one bucket's exchange of the method both ways
    (hooks/topology.py) and keep hierarchical only where it was faster. Returns the ranks per
    node chosen (0: flat) and what was measured (``state.topology_probe``, ``stats()``)."""
    from .topology import PROBE_MAX_BYTES, probe_bucket, probe_config, probe_times

    cfg = probe_config(config)
    named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
    cap = min(getattr(model, "bucket_bytes_cap", PROBE_MAX_BYTES) or PROBE_MAX_BYTES,
              PROBE_MAX_BYTES)
    params = probe_bucket(named, cap)

    def make_state():
        return HookState(name, cfg, group=group, **_named(model.module))

    flat, hier = probe_times(make_state, params, group, [pair], local,
                             _device(model.module))
    chosen = local if hier < flat else 0
    return chosen, {"flat_s": flat, "hierarchical_s": hier,
                    "chosen": "hierarchical" if chosen else "flat",
                    "ranks_per_node": local, "bucket_bytes": 4 * (
                        params[-1].offset + params[-1].numel)}


def _choose_method(model, spec, optimizer, group, ranks, options, made, scaler=None):
    """method="auto" (hooks/auto.py): every rank validates the options against every
    candidate and the ranks agree, then each candidate's exchange is timed on ``group``.
    Returns (the chosen method, the options, what the probe measured)."""
    from . import auto

    def build():
        opts = merge_options(spec, options, auto=True)[1]
        cfgs = auto.configs(opts, optimizer, scaler)
        for name, config in cfgs.values():  # whichever wins, registration then succeeds
            optimizer_binding.check_method(name, config, optimizer)
        _check_compiled_autograd(model)
        return (opts, cfgs), {"method": spec, "options": repr(sorted(opts.items())),
                              "candidates": list(cfgs),
                              "bucket_bytes_cap": getattr(model, "bucket_bytes_cap", None),
                              **fingerprint(model.module, optimizer, None)}

    (opts, cfgs), _ = agree(group, ranks, build, lambda _: discard(made))
    names, numels = trainable(model.module)
    named = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]

    def make_state(name, cfg):
        return HookState(name, cfg, group=group, param_names=dict(names),
                         param_numels=dict(numels))

    try:
        found = auto.probe(make_state, cfgs, named, group,
                           getattr(model, "bucket_bytes_cap", None), _device(model.module))
    except BaseException:
        discard(made)
        raise
    return found["chosen"], opts, found


def _device(module):
    """The device of the module's first parameter (the CPU without any)."""
    return next((p.device for p in module.parameters()), None)


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


def _method_config(model, method, optimizer, options):
    """(name, config) of the method with this optimizer; the module's refusals."""
    # what the method needs from the optimizer (DGC: its momentum) is the method's business
    name, config = for_optimizer(method, options, optimizer)
    optimizer_binding.check_method(name, config, optimizer)
    for mname, mod in model.module.named_modules():
        if isinstance(mod, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and mod.sparse:
            raise ValueError(f"module {mname!r} is {type(mod).__name__}(sparse=True): its "
                             f"sparse gradients cannot go through a DDP comm hook's flat "
                             f"bucket; allowed sparse=False (dense gradients, compressed as "
                             f"any other)")
    return name, config
