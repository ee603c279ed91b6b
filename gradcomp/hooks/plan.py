"""What a registration decided, handed whole to the state it builds (hooks/state.py): the
adapters (ddp.py, fsdp.py) validate on every rank, agree, create their process groups and
measure what ``auto`` settings need, then build the state once from a :class:`Plan`. Nothing
is assigned on the state afterwards."""
from __future__ import annotations

import dataclasses
import enum

import torch
import torch.distributed as dist


class Sharding(str, enum.Enum):
    """Which parallelism the state serves. ``NONE`` (DDP, or a state built by hand) is the
    empty string: false, as "not sharded" reads."""

    NONE = ""
    FSDP = "FSDP"
    HSDP = "HSDP"


@dataclasses.dataclass(frozen=True)
class Plan:
    """``scaler``: the GradScaler whose loss scale the gradients carry (DDP). ``sharding``:
    the adapter. ``lane_groups``: a process group per lane after the first. ``topology``:
    (ranks per node, a (node group, cross-node group) pair per lane) of a hierarchical
    topology, or None (flat). ``stats_group``: where the warm-up's statistics and the flags
    go round when that is not the state's own group (HSDP: the whole mesh). ``owned_groups``:
    the groups registration created, destroyed at ``close()``. ``load_group``: the loads'
    agreement (checkpoint.py's ``load_group``). ``topology_probe``, ``method_probe``: what ``topology="auto"`` and
    ``method="auto"`` measured, for ``stats()``."""

    scaler: object = None
    sharding: Sharding = Sharding.NONE
    lane_groups: tuple = ()
    topology: tuple | None = None
    stats_group: object = None
    owned_groups: tuple = ()
    load_group: object = None
    topology_probe: dict | None = None
    method_probe: dict | None = None

    @property
    def reuse_skipped(self) -> bool:
        """Whether a step skipped for inf/NaN takes its index again (a GradScaler reruns it
        under DDP; under FSDP/HSDP only the affected shard's replicas would know of it)."""
        return not self.sharding

    def portable(self) -> "Plan":
        """The plan without its runtime (process groups, the scaler): what a pickled state
        keeps."""
        return Plan(sharding=self.sharding, topology_probe=self.topology_probe,
                    method_probe=self.method_probe)


def from_model(model, group=None):
    """A state built by hand from ``model`` (DDP-wrapped or not): its trainable parameters'
    names by id and sizes by name, and the process group the state issues on: ``group``,
    else (under torch.distributed) a new one over the model's ranks, collective (every rank
    builds its state), so DDP's own collectives on the default group never interleave with
    the exchanges. Returns (names, numels, group, the groups created here)."""
    module = getattr(model, "module", model)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"model= must be a torch.nn.Module, got {type(model).__name__}")
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    owned = []
    if group is None and dist.is_initialized():
        group = dist.new_group(ranks=dist.get_process_group_ranks(
            getattr(model, "process_group", None) or dist.group.WORLD))
        owned = [group]
    return ({id(p): n for n, p in trainable}, {n: p.numel() for n, p in trainable}, group,
            owned)
