"""Host reads in compressed steps (docs/design.md, "Host reads"): on 2 gloo ranks, a small MLP
over several DDP buckets (and four FSDP2 units), ``warmup="none"``, every call of ``item``,
``tolist``, ``__bool__``, ``__int__``, ``__float__``, ``nonzero``, ``cpu`` or ``numpy`` on a
tensor is counted on every thread during four compressed steps, by where it was made.

No compressed exchange reads a tensor on the host: the inf/NaN guard's flag goes into host
memory (a numpy array) by a copy issued without a wait and is read from there at the next
step's start, or the next outer round's with local steps (hooks/guard.py, kernels/host.py).
TernGrad's CPU statistics (``_stats_by_segment``: numpy's pairwise sums) read the host on
the CPU only; its GPU path makes none (``bench/gpu_check.sh sync`` shows each method's GPU
host waits). Plain DDP and FSDP2 make none here, so a host read added anywhere on the hook
path fails this test."""
import collections
import threading

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from conftest import train_steps

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy")
LOCAL = ("sparseloco", "diloco")
CPU_ONLY = {"terngrad": {"_stats_by_segment", "_segment_sums"}}
CAP = 0.1  # MB: three buckets of this net
STEPS = 4


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 272), nn.Tanh(), nn.Linear(272, 10))


class _Counter:
    """Wraps the read methods of torch.Tensor; counts (method, calling function) while armed."""

    def __init__(self):
        import sys
        self.armed, self.seen, self._lock, self._sys = False, collections.Counter(), \
            threading.Lock(), sys
        for name in READS:
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name, orig):
        def counted(t, *args, **kwargs):
            if self.armed:
                caller = self._sys._getframe(1).f_code
                with self._lock:
                    self.seen[(name, caller.co_name, caller.co_filename.rsplit("/", 1)[-1])] += 1
            return orig(t, *args, **kwargs)
        return counted


def _model(adapter, world):
    net = _net()
    if adapter == "ddp":
        return net, DDP(net, bucket_cap_mb=CAP)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    for m in net[::2]:
        fully_shard(m, mesh=mesh)
    return net, fully_shard(net, mesh=mesh)


def _count(rank, world, cases):
    counter = _Counter()
    out = {}
    for adapter, method in cases:
        net, model = _model(adapter, world)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        kw = {"warmup": "none", "min_numel": 0}
        if method in LOCAL:
            kw["local_steps"] = 2
        state = (None if method == "plain"
                 else gradcomp.register(model, method, optimizer=opt, **kw))
        train_steps(model, opt, rank, range(2))
        counter.seen.clear()
        counter.armed = True
        train_steps(model, opt, rank, range(2, 2 + STEPS))
        counter.armed = False
        stats = None if state is None else state.stats()
        out[(adapter, method)] = (dict(counter.seen), stats and stats["compressing_since"],
                                  stats and stats["run_ratio"])
        if state is not None:
            state.close()
    return out


def test_compressed_steps_read_no_tensor_on_the_host(spawn):
    methods = sorted(m["name"] for m in gradcomp.methods() if m["name"] != "allreduce")
    cases = [("ddp", "plain"), ("fsdp", "plain")]
    cases += [("ddp", m) for m in methods]
    # the local-steps methods are refused on FSDP's 1-D mesh (HSDP: tests/test_hsdp_local.py)
    cases += [("fsdp", m) for m in methods if m not in LOCAL]
    for rank_out in spawn(_count, 2, args=(cases,), timeout=600):
        for (adapter, method), (seen, since, ratio) in rank_out.items():
            where = f"{adapter}/{method}: {seen}"
            if method == "plain":
                assert not seen, where
                continue
            assert since == 0 and ratio > 1.5, (where, since, ratio)  # it compressed
            assert {fn for _, fn, _ in seen} <= CPU_ONLY.get(method, set()), where
