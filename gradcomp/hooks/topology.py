"""Hierarchical reduction: dense inside a node, compressed between nodes (as ZeRO++'s qgZ,
Bagua's hierarchical ByteGrad and CGX do).

With L ranks per node (node n holds ranks nL .. nL+L-1, torchrun's assignment), one bucket's
exchange is:
  1. a dense reduce-scatter inside the node: local rank j gets shard j of the node's average;
  2. the method's compressed exchange of shard j between the ranks of local index j on every
     node (one process group per local index), so every node's NICs carry a 1/L share and
     work in parallel; the method averages the node averages: the job's average;
  3. a dense allgather inside the node puts the shards back together.

Shards are cut per parameter, never per bucket, so a parameter's pieces (and the memory,
random streams and choices kept for each) do not depend on its bucket neighbours: each
parameter is viewed as rows (its first dimension; a 0-d or 1-d one as single elements), its
rows are split into L contiguous, nearly equal parts, and shard j holds every parameter's
part j, in bucket order, padded at the end to the longest shard. Piece j of parameter
``name`` is named ``name#j/L`` in the memory and in checkpoints.
"""
from __future__ import annotations

import os
import threading

import torch

from .. import comm
from ..compressors.base import ParamSlice
from ..config import ONE_STEP_EACH, check

SEP = "#"


def node_size(config, world: int, env=None) -> int:
    """Ranks per node of the hierarchy the config asks for in a job of ``world`` ranks, or 0
    for flat. Raises ValueError naming the bad value."""
    env = os.environ if env is None else env
    local = config.local_size or int(env.get("LOCAL_WORLD_SIZE") or 0)
    if config.topology == "flat":
        return 0
    if config.topology == "auto" and not (1 < local < world):
        return 0  # one node, or one rank per node: nothing to gain
    check(local >= 1, "topology", config.topology,
          "'hierarchical' with a node size: local_size=L, or torchrun's LOCAL_WORLD_SIZE")
    check(world % local == 0, "local_size", local,
          f"a divisor of the world size {world} (ranks per node, every node alike)")
    return local


def base_name(name: str) -> str:
    """The parameter a memory entry belongs to (a piece's name without its ``#j/L``)."""
    return name.split(SEP, 1)[0]


class Shards:
    """One bucket layout cut into L shards (see the module doc): ``index`` (L * length,)
    maps each position of the shard-major buffer to its element of the bucket (the padding
    to the extra element n); ``mine`` are this rank's pieces as ParamSlices of its shard,
    ``owner`` the bucket position of each piece's parameter and ``ranges`` its element range
    in that parameter."""

    def __init__(self, params: list[ParamSlice], L: int, local: int, device):
        n = sum(p.numel for p in params)
        cuts = []  # per shard: [(param index, start, end)] in the parameter's flat elements
        for j in range(L):
            shard = []
            for i, p in enumerate(params):
                rows = p.shape[0] if len(p.shape) >= 2 else p.numel
                per_row = p.numel // rows if rows else 0
                a, b = (j * rows // L) * per_row, ((j + 1) * rows // L) * per_row
                if b > a:
                    shard.append((i, a, b))
            cuts.append(shard)
        self.length = max(sum(b - a for _, a, b in s) for s in cuts) if cuts else 0
        index = torch.full((L, self.length), n, dtype=torch.long)
        for j, shard in enumerate(cuts):
            off = 0
            for i, a, b in shard:
                index[j, off : off + b - a] = torch.arange(params[i].offset + a, params[i].offset + b)
                off += b - a
        self.index = index.reshape(-1).to(device)
        self.numel = n
        self.mine, self.owner, self.ranges, off = [], [], [], 0

        for i, a, b in cuts[local]:
            p = params[i]
            shape = (b - a,) if len(p.shape) < 2 else ((b - a) // (p.numel // p.shape[0]), *p.shape[1:])
            self.mine.append(ParamSlice(f"{p.name}{SEP}{local}/{L}", shape, off, b - a, p.numel))
            self.owner.append(i)
            self.ranges.append((a, b))
            off += b - a
        self.real = off  # this rank's elements; the shard is padded to ``length``

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The bucket x in shard-major order (L * length,), padding zero."""
        return torch.cat([x, x.new_zeros(1)])[self.index]

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`gather`: the bucket (n,) from its shard-major form."""
        out = y.new_empty(self.numel + 1)
        out.index_copy_(0, self.index, y)  # every padding slot lands on the extra element
        return out[: self.numel]

    def pieces(self, tensors):
        """This rank's pieces of the bucket's parameter tensors (views), in shard order."""
        if tensors is None:
            return None
        return [tensors[i].detach().reshape(-1)[a:b] for i, (a, b) in zip(self.owner, self.ranges)]

    def live(self, live):
        """A method's per-parameter live values (lists aligned with the bucket) for the pieces."""
        if live is None:
            return None
        return tuple([v[i] for i in self.owner] if isinstance(v, list) else v for v in live)


# ----------------------------------------------------------------------------- topology=auto
PROBE_REPEATS = 3  # timed exchanges per topology (after one untimed: first-use costs)
PROBE_MAX_BYTES = 25 * 1024 * 1024  # the probe bucket: at most DDP's default bucket


class Hierarchy:
    """A component of the state: the topology it runs (``local_size`` ranks per node; 0:
    flat) and each bucket layout's shards, built once (thread-safe: the lanes ask)."""

    def __init__(self):
        self.local_size = 0
        self._cache: dict = {}
        self._lock = threading.Lock()

    def __getstate__(self):  # pickled flat: the groups are not
        return {}

    def __setstate__(self, d):
        self.__init__()

    def shards(self, params, local: int, device) -> Shards:
        """The shards of a bucket laid out as ``params``, for local rank ``local``."""
        key = (tuple(p.name for p in params), str(device))
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                hit = self._cache[key] = Shards(params, self.local_size, local, device)
            return hit


def probe_bucket(named_params, cap_bytes: int) -> list[ParamSlice]:
    """The bucket the probe exchanges: the model's parameters in DDP's order (the last
    first), up to one bucket's bytes (at least one parameter), laid out end to end."""
    out, offset = [], 0
    for name, p in reversed(list(named_params)):
        if out and 4 * (offset + p.numel()) > cap_bytes:
            break
        out.append(ParamSlice(name, tuple(p.shape), offset, p.numel()))
        offset += p.numel()
    return out


def probe_config(config):
    """``config`` as a probe runs it: compressing from the first step, synchronous, flat,
    without Adam or local steps (a throwaway state keeps nothing past the probe)."""
    from dataclasses import replace
    return replace(config, warmup="none", dense_steps=None, adam="off", delay=0,
                   topology="flat", **ONE_STEP_EACH)


def probe_times(make_state, params, group, pairs, local, device=None) -> tuple[float, float]:
    """Seconds one exchange of the probe bucket takes, flat and hierarchical (see
    :func:`time_exchanges`), with throwaway states of the method (``make_state()``:
    compressing from the first step, no memory kept afterwards)."""
    def hierarchical():
        st = make_state()
        st.set_topology(local, pairs)
        return st
    return tuple(time_exchanges([make_state, hierarchical], params, group, device))


def time_exchanges(make_states, params, group, device=None) -> list[float]:
    """Seconds one exchange of the bucket ``params`` takes with each state that
    ``make_states`` build (collective: every rank builds and times the same ones in the same
    order): after one untimed exchange (allocations, connections), the median of
    PROBE_REPEATS, each started together (a barrier); the slowest rank's, so every rank
    decides alike. Each state is closed after its timing. ``device``: the model's (the
    bucket lives there, as the job's will; on CUDA each timed span ends synchronized)."""
    import statistics
    import time

    device = torch.device(device or "cpu")
    cuda = device.type == "cuda"
    n = params[-1].offset + params[-1].numel
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for make in make_states:
        st = make()
        try:
            st.entries.reduce(x.clone(), params)
            spans = []
            for _ in range(PROBE_REPEATS):
                y = x.clone()
                if cuda:
                    torch.cuda.synchronize(device)
                comm.barrier(group)
                t0 = time.perf_counter()
                st.entries.reduce(y, params)
                if cuda:
                    torch.cuda.synchronize(device)
                spans.append(time.perf_counter() - t0)
        finally:
            st.close()
        times.append(statistics.median(spans))
    t = torch.tensor(times, dtype=torch.float64, device=device)
    comm.all_reduce_now(t, "max", group)  # every rank decides alike
    return [float(v) for v in t.cpu()]
