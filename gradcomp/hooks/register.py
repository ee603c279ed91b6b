"""``gradcomp.register``: the one line, for a DDP model (hooks/ddp.py) or a model sharded
with FSDP2's ``fully_shard`` (hooks/fsdp.py)."""
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from . import ddp, fsdp
from .state import GradcompState


def register(model, method: str, *, optimizer=None, scaler=None, lanes: int = 4,
             process_group=None, log_dir=None, log_all_ranks=False, log_details=False,
             **options) -> GradcompState:
    """Register a gradcomp communication hook on a DDP model (or a ``fully_shard`` model:
    docs/fsdp.md) and return its state.

    ``method`` is a name or spec (``"powersgd:rank=2"``); ``options`` are the method's
    options (``gradcomp.methods()`` lists them). ``optimizer`` is required for ``dgc``, which
    applies the optimizer's momentum and weight decay in the hook, read from its param groups
    at every step (schedulers that cycle momentum are followed), and keeps the optimizer from
    applying them again (zero only while ``optimizer.step()`` runs). ``scaler``: the ``torch.amp.GradScaler`` of an fp16
    job, whose loss scale the gradients carry; the hook keeps its memory unscaled so that
    scale changes do not corrupt it (not with ``delay``: a rank's overflow would reach the
    others only D steps later). With ``local_steps`` > 1 ``optimizer`` is required: the
    outer step runs from its step post-hook every ``local_steps`` steps (hooks/local_steps.py).
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
    common = dict(optimizer=optimizer, scaler=scaler, lanes=lanes, log_dir=log_dir,
                  log_all_ranks=log_all_ranks, log_details=log_details, **options)
    if sharded:
        if process_group is not None:
            raise ValueError("process_group= with an FSDP model: allowed None (the groups "
                             "come from the model's device mesh)")
        return fsdp.register(model, method, **common)
    return ddp.register(model, method, process_group=process_group, **common)
