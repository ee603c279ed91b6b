"""Peers: other libraries' methods run on the harness's own jobs, beside gradcomp's.

``torchft-diloco`` is torchft's own ``torchft.local_sgd.DiLoCo`` (Douillard et al. 2023,
https://arxiv.org/abs/2311.08105; with ``fragments`` > 1 its streaming form, Douillard et
al. 2025, https://arxiv.org/abs/2501.18512), not a re-implementation: each rank is one
torchft replica group (``Manager`` over torchft's ``ProcessGroupGloo``, group world size
1), a ``LighthouseServer`` on rank 0 forms the quorum, and every ``sync_every`` inner steps
each fragment's fp32 pseudo-gradient is averaged over the replicas and applied by an outer
``torch.optim.SGD`` (Nesterov), torchtitan's defaults: ``outer_lr=0.7``,
``outer_momentum=0.9``. Everything else is :func:`.train.train_lm`'s job unchanged (model,
data, seeds, the inner AdamW and its groups, schedule, clip, evaluation of rank 0's model);
the inner steps have no DDP: each replica steps on its own batches, as DiLoCo does.

Bytes on the wire are counted as gradcomp counts an fp32 allreduce: every tensor torchft's
manager all-reduces costs ``2 (W - 1) / W * element_size * numel`` per rank (a ring), at the
step it is issued. Needs ``pip install gradcomp[peers]`` (torchft 0.2.0).
"""
from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist

# each peer's options and their defaults; a value's type is its default's
PEERS = {
    "torchft-diloco": {"sync_every": 16, "fragments": 1, "outer_lr": 0.7,
                       "outer_momentum": 0.9, "fragment_sync_delay": 0,
                       "fragment_update_alpha": 0.0},
}


def is_peer(spec: str) -> bool:
    return spec.strip().partition(":")[0] in PEERS


def missing(spec: str) -> str | None:
    """Why ``spec``'s peer cannot run here (its library is not installed), or None."""
    import importlib.util
    if importlib.util.find_spec("torchft") is None:
        return (f"{spec.strip().partition(':')[0]} needs torchft 0.2.0: "
                f"pip install 'gradcomp[peers]'")
    return None


def parse(spec: str) -> tuple[str, dict]:
    """``"torchft-diloco:sync_every=64,fragments=4"`` as (name, options with the defaults
    filled in). ValueError names the bad value and what is allowed."""
    name, _, rest = spec.strip().partition(":")
    if name not in PEERS:
        raise ValueError(f"{name!r} is not a peer: allowed {', '.join(PEERS)}")
    opts = dict(PEERS[name])
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = (p.strip() for p in item.partition("="))
        if not eq or key not in opts:
            allowed = ", ".join(f"{k}={v}" for k, v in PEERS[name].items())
            raise ValueError(f"bad option {item!r} for {name}: allowed {allowed} (the defaults)")
        kind = type(PEERS[name][key])
        try:
            opts[key] = kind(value)
        except ValueError:
            raise ValueError(f"bad option {item!r} for {name}: expected "
                             f"{'an integer' if kind is int else 'a number'}") from None
    _check(name, opts)
    return name, opts


def _check(name: str, o: dict) -> None:
    def bad(key, allowed):
        raise ValueError(f"bad option {key}={o[key]} for {name}: allowed {allowed}")
    if o["sync_every"] < 1:
        bad("sync_every", "an integer >= 1")
    if o["fragments"] < 1 or o["sync_every"] % o["fragments"]:
        bad("fragments", f"a divisor of sync_every={o['sync_every']} (each fragment syncs "
                         f"at its own step of the round)")
    if not 0 <= o["fragment_sync_delay"] < o["sync_every"] // o["fragments"]:
        bad("fragment_sync_delay", f"0 to {o['sync_every'] // o['fragments'] - 1} (fewer "
                                   f"steps than sync_every / fragments)")
    if not (math.isfinite(o["outer_lr"]) and o["outer_lr"] > 0):
        bad("outer_lr", "a number > 0")
    if not 0 <= o["outer_momentum"] < 1:
        bad("outer_momentum", "0 <= m < 1 (Nesterov when > 0)")
    if not 0 <= o["fragment_update_alpha"] <= 1:
        bad("fragment_update_alpha", "0 to 1 (the share of the local parameters kept)")


def fragments(net: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    """``net`` cut into ``n`` consecutive fragments of about equal parameter counts, at the
    boundaries of its top-level modules and of the blocks of a container among them (a GPT:
    the embeddings with the first blocks, ..., the last blocks with the final norm and head),
    as Streaming DiLoCo splits a transformer by layers."""
    units = []
    for child in net.children():
        inner = list(child.children()) if isinstance(child, (torch.nn.Sequential,
                                                             torch.nn.ModuleList)) else []
        units += inner or [child]
    units = [u for u in units if any(True for _ in u.parameters())]
    ids = [id(p) for u in units for p in u.parameters()]
    if len(ids) != len(set(ids)) or set(ids) != {id(p) for p in net.parameters()}:
        raise ValueError(f"fragments={n}: {type(net).__name__}'s parameters do not split into "
                         f"its top-level modules without sharing (each fragment syncs its own)")
    if n > len(units):
        raise ValueError(f"fragments={n}: {type(net).__name__} has {len(units)} modules to "
                         f"split; allowed 1 to {len(units)}")
    prefix = [0]
    for u in units:
        prefix.append(prefix[-1] + sum(p.numel() for p in u.parameters()))
    cuts, lo = [], 1
    for k in range(1, n):  # the boundary nearest k/n of the parameters, a unit left for each later cut
        j = min(range(lo, len(units) - (n - k) + 1),
                key=lambda j: abs(prefix[j] - k * prefix[-1] / n))
        cuts.append(j)
        lo = j + 1
    bounds = [0] + cuts + [len(units)]
    return [torch.nn.ModuleList(units[a:b]) for a, b in zip(bounds, bounds[1:])]


class TorchftDiLoCo:
    """torchft's DiLoCo around the harness's model and inner optimizer on this rank. Built
    on every rank at once (rank 0 starts the lighthouse and sends its address over the
    harness's process group); ``stats()`` has the keys of a gradcomp state's for the
    harness's rows; ``close()`` takes torchft's hooks off and shuts it down."""

    def __init__(self, net, optimizer, rank: int, world: int, opts: dict):
        # torchft's Rust side logs every quorum and commit at INFO
        os.environ.setdefault("RUST_LOG", "warn")
        why = missing("torchft-diloco")
        if why:
            raise ImportError(why)
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.rank, self.world, self.opts = rank, world, dict(opts)
        self.lighthouse = (LighthouseServer(bind="[::]:0", min_replicas=world)
                           if rank == 0 else None)
        addr = [self.lighthouse.address() if self.lighthouse else None]
        dist.broadcast_object_list(addr, src=0)
        # each rank is its own replica group of one, with its own store
        self.store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        long = datetime.timedelta(seconds=600)
        counter = self

        class CountingManager(Manager):
            def allreduce(self, tensor, *args, **kwargs):
                counter._issued(tensor, self.num_participants())
                return super().allreduce(tensor, *args, **kwargs)

        self.manager = CountingManager(
            pg=ProcessGroupGloo(timeout=long), load_state_dict=None, state_dict=None,
            min_replica_size=world, use_async_quorum=False, replica_id=f"gradcomp_{rank}",
            store_addr="localhost", store_port=self.store.port, rank=0, world_size=1,
            lighthouse_addr=addr[0], timeout=long, quorum_timeout=long,
            connect_timeout=datetime.timedelta(seconds=60),
            # every rank builds the model from the same seed: nothing to heal at step 0
            init_sync=False)
        self.fragments = fragments(net, opts["fragments"])
        m = opts["outer_momentum"]
        self.outer = [torch.optim.SGD(f.parameters(), lr=opts["outer_lr"], momentum=m,
                                      nesterov=m > 0) for f in self.fragments]
        self.raw_step = sum(p.numel() * p.element_size() for p in net.parameters())
        self.step, self.step_wire, self.run_wire, self.last_wire, self.syncs = 0, 0.0, 0.0, 0.0, 0
        self.diloco = DiLoCo(self.manager, self.fragments, optimizer, self.outer,
                             sync_every=opts["sync_every"],
                             fragment_sync_delay=opts["fragment_sync_delay"],
                             fragment_update_alpha=opts["fragment_update_alpha"])
        self.diloco.__enter__()
        # after DiLoCo's: runs once a step's sync (if any) is done
        self._hook = optimizer.register_step_post_hook(self._stepped)

    def _issued(self, tensor, participants: int) -> None:
        W = participants
        self.step_wire += 2 * (W - 1) / W * tensor.element_size() * tensor.numel()

    def _stepped(self, *_):
        self.step += 1
        self.last_wire, self.step_wire = self.step_wire, 0.0
        self.run_wire += self.last_wire
        self.syncs += self.last_wire > 0

    def stats(self) -> dict:
        """The last step's bytes and the run's, with gradcomp's keys (``sent_bytes`` is what
        crossed the ring: the pseudo-gradients go as they are, fp32). ``raw``: an fp32
        allreduce of every parameter's gradient, each step."""
        W = self.world
        raw_wire = self.raw_step * 2 * (W - 1) / W
        run_raw = raw_wire * self.step
        return {"step": self.step, "raw_bytes": self.raw_step, "raw_wire_bytes": raw_wire,
                "wire_bytes": self.last_wire, "sent_bytes": self.last_wire * W / (2 * (W - 1)),
                "ratio": raw_wire / self.last_wire if self.last_wire else float("inf"),
                "run_wire_bytes": self.run_wire, "run_raw_bytes": run_raw,
                "run_ratio": run_raw / self.run_wire if self.run_wire else float("inf"),
                "syncs": self.syncs, "manager_step": self.manager.current_step(),
                "warmup_switch_step": None, "compressing": False}

    def close(self) -> None:
        self._hook.remove()
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        dist.barrier()  # no rank leaves while the other still needs the lighthouse
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def attach(net, spec: str, optimizer, rank: int, world: int) -> TorchftDiLoCo:
    """Run ``spec``'s peer around ``net`` (not wrapped in DDP) and its inner ``optimizer``."""
    name, opts = parse(spec)
    if name == "torchft-diloco":
        return TorchftDiLoCo(net, optimizer, rank, world, opts)
    raise AssertionError(f"peer {name} has no attach")  # PEERS and attach disagree
