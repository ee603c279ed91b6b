"""``gradcomp.register``: the one line, for a DDP model (hooks/ddp.py) or a model sharded
with FSDP2's ``fully_shard`` (hooks/fsdp.py)."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import ddp, fsdp
from . import optimizer as optimizer_binding
from .agree import agree
from ..config import quote
from .options import check_keywords, merge_options
from .public import State

# register()'s own keywords (every other keyword is an option of the method)
OWN = ("optimizer", "scaler", "lanes", "process_group", "log_dir", "log_all_ranks",
       "log_details", "outer_optimizer")


def register(model, method: str, *args, optimizer=None, scaler=None,
             lanes: int | None = None, process_group=None, log_dir=None, log_all_ranks=False,
             log_details=False, outer_optimizer=None, **options) -> State:
    """Register a gradcomp communication hook on a DDP model (or a ``fully_shard`` model:
    docs/fsdp.md) and return its :class:`State` (hooks/public.py: the user's 15 names).

    ``method`` is a name or spec (``"powersgd:rank=2"``); ``options`` are the method's
    options (``gradcomp.methods()`` lists them). ``optimizer`` is required for ``dgc``, which
    applies the optimizer's momentum and weight decay in the hook, read from its param groups
    at every step (schedulers that cycle momentum are followed), and keeps the optimizer from
    applying them again (zero only while ``optimizer.step()`` runs). ``scaler``: the ``torch.amp.GradScaler`` of an fp16
    job, whose loss scale the gradients carry; the hook keeps its memory unscaled so that
    scale changes do not corrupt it (not with ``delay``: a rank's overflow would reach the
    others only D steps later). With ``local_steps`` > 1 ``optimizer`` is required: the
    outer step runs from its step post-hook every ``local_steps`` steps (hooks/local_steps.py),
    with the optimizer ``outer_optimizer(tensors)`` builds (default: SGD with Nesterov).
    With Adam/AdamW too (docs/adam.md): without it, an Adam/AdamW's first ``step()`` raises.
    ``lanes``: DDP only, how many buckets' exchanges run side by side (4 where None;
    docs/topology.md). ``log_dir``: TensorBoard scalars per step (rank 0
    only unless ``log_all_ranks``; ``log_details`` adds costly diagnostics such as PowerSGD's
    approximation error: see :meth:`State.attach`). Must be called on every rank (it is
    collective): ranks that registered different methods or options all raise ValueError.

    Example::

        model = DistributedDataParallel(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = gradcomp.register(model, "dgc", ratio=0.001, optimizer=opt)
    """
    sharded = fsdp.is_fsdp(model)
    if not dist.is_available() or not dist.is_initialized():
        _check_model(model, sharded)
        raise RuntimeError("gradcomp.register needs torch.distributed initialized (it is not, or "
                           "destroy_process_group() was called): call "
                           "torch.distributed.init_process_group() first, on every rank")

    def check():  # every argument, on every rank, before anything else is collective
        _check_model(model, sharded)
        _check_positional(method, args)
        check_arguments(method, options, optimizer, scaler, lanes, log_all_ranks, log_details)
        if sharded and lanes is not None:
            raise ValueError(f"lanes={quote(lanes)} with an FSDP model: it has no effect there "
                             f"(each exchange runs on one lane, overlapped with backward); "
                             f"allowed None (leave it out)")
        _check_groups(model, sharded, process_group)
        return None, {}

    # A rank given something wrong still joins the others and every rank raises: the first
    # collective of a registration is this agreement (over the DDP model's group, or every
    # rank), not one a refused rank would leave the others waiting in.
    group, ranks = _first_group(model, sharded, process_group)
    agree(group, ranks, check, lambda _: None)
    common = dict(optimizer=optimizer, scaler=scaler, log_dir=log_dir,
                  outer_optimizer=outer_optimizer,
                  log_all_ranks=log_all_ranks, log_details=log_details, **options)
    state = fsdp.register_fsdp(model, method, **common) if sharded else ddp.register_ddp(
        model, method, process_group=process_group, lanes=lanes or ddp.LANES, **common)
    if optimizer is None:
        state.refuse_unseen_adam()
    return State(state)


def _check_model(model, sharded: bool) -> None:
    """The model register() takes: a DDP model or a fully_shard-ed one (TypeError)."""
    if not sharded and not isinstance(model, DistributedDataParallel):
        raise TypeError(f"register() needs a torch.nn.parallel.DistributedDataParallel "
                        f"model or a model sharded with torch.distributed.fsdp.fully_shard,"
                        f" got {type(model).__name__}")


def _check_positional(method, args) -> None:
    """register() takes the model and the method by position, the rest by keyword: an
    optimizer (or anything) given by position is named, with the call to write."""
    if args:
        kinds = ", ".join(type(a).__name__ for a in args)
        raise TypeError(f"gradcomp.register takes the model and the method by position and "
                        f"everything else by keyword; got {len(args)} more positional "
                        f"argument(s) ({kinds}): write gradcomp.register(model, "
                        f"{quote(method)}, optimizer=opt)")


def _check_groups(model, sharded: bool, process_group) -> None:
    """The model's process groups or mesh, and ``process_group=`` (ValueError naming what)."""
    if sharded:
        if process_group is not None:
            raise ValueError("process_group= with an FSDP model: allowed None (the groups "
                             "come from the model's device mesh)")
        fsdp.check_model(model)
    else:
        ddp.check_group(model, process_group)


def check_arguments(method, options: dict, optimizer, scaler, lanes, log_all_ranks,
                    log_details) -> None:
    """register()'s arguments, each refused by name (TypeError/ValueError): the method's spec,
    keywords that are neither register's nor the method's (with the nearest valid one), and
    objects of the wrong kind."""
    name = merge_options(method, {}, auto=True)[0]
    check_keywords(name, options, OWN, "gradcomp.register")
    merge_options(method, options, auto=True)
    if optimizer is not None and not isinstance(optimizer_binding.unwrap(optimizer),
                                                torch.optim.Optimizer):
        raise TypeError(f"optimizer={quote(optimizer)} ({type(optimizer).__name__}): allowed a "
                        f"torch.optim.Optimizer (or a framework's wrapper of one, such as "
                        f"Lightning's or Accelerate's), or None")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler={quote(scaler)} ({type(scaler).__name__}): allowed a "
                        f"torch.amp.GradScaler, or None")
    if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, int)
                              or not 1 <= lanes <= ddp.MAX_LANES):
        raise ValueError(f"invalid lanes={quote(lanes)}: allowed an integer in "
                         f"[1, {ddp.MAX_LANES}] (each lane is a process group and a thread)")
    for key, v in (("log_all_ranks", log_all_ranks), ("log_details", log_details)):
        if not isinstance(v, bool):
            raise TypeError(f"{key}={quote(v)}: allowed True or False")


def _first_group(model, sharded, process_group):
    """(group, its ranks) of registration's first agreement: the DDP model's group, else the
    process_group= given, else every rank's."""
    for g in (None if sharded else getattr(model, "process_group", None), process_group):
        if isinstance(g, dist.ProcessGroup):
            try:
                return g, dist.get_process_group_ranks(g)
            except (KeyError, ValueError, RuntimeError):
                pass  # not a live group of this rank: every rank's, below
    return dist.group.WORLD, list(range(dist.get_world_size()))
