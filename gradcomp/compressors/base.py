"""The narrow interface every method implements, and the registry that names them.

A method is a frozen config dataclass plus a :class:`Compressor` whose one job is
``reduce(x, ctx) -> average``: turn this rank's flat fp32 gradient ``x`` into the average
over ranks, moving compressed messages through ``ctx.comm``. Persistent per-parameter state
(residuals, velocities, low-rank factors) lives in ``ctx``, owned by the hook state, so the
compressor itself is stateless apart from its config and a new method is one small file.

One rule every method keeps: the result for a parameter depends on that parameter alone,
never on which other parameters share its bucket (thresholds, scales, random streams and
ownership are all per parameter). DDP lays buckets out differently on its first iteration
than after its rebuild, so a job resumed from a checkpoint sees other buckets at its first
step than the uninterrupted job did; this rule is what makes the resumed job bit-exact.
"""
from __future__ import annotations

import fnmatch
import functools
import math
import zlib
from abc import ABC
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..config import Adam, MethodConfig, RESIDUAL
from ..kernels.work import scratch  # noqa: F401  (the compressors' work buffers)
from .rows import dense_rows, sum_ranks


class Collectives(Protocol):
    """Collectives on flat tensors; with world size 1 they are the identity."""

    world_size: int
    rank: int

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor: ...
    def allgather(self, t: torch.Tensor) -> torch.Tensor: ...
    def all_to_all(self, t: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class ParamSlice:
    """Where a parameter (or, under a hierarchical topology, this rank's piece of one) lies
    in a flat bucket. ``whole``: the whole parameter's element count where this is a piece
    (0: it is whole): size rules such as ``min_numel`` go by the whole parameter."""

    name: str
    shape: tuple
    offset: int
    numel: int
    whole: int = 0

    @property
    def size(self) -> int:
        """The whole parameter's element count (what size rules compare)."""
        return self.whole or self.numel


class BucketContext(Protocol):
    """What a compressor sees of one bucket at one step (implemented by the hook state)."""

    comm: Collectives
    step: int                 # optimizer steps completed before this one
    compressed: int           # compressed steps before this one (0 in the first)
    params: list[ParamSlice]  # layout of x
    device: torch.device      # x's device
    grad_dtype: torch.dtype   # the gradient's own dtype (x itself is always fp32)
    live: object              # what Compressor.live returned when the bucket was submitted
    logging: bool             # a writer is attached: per-step scalars are wanted
    details: bool             # ... and costly diagnostics too (PowerSGD's approximation error)

    def memory(self, slot: str) -> torch.Tensor:
        """Persistent fp32 flat buffer laid out like x, zero at first use, kept per parameter."""

    def memory_next(self, slot: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(current, next) for an exchange that rewrites EVERY element of ``slot``: current
        is :meth:`memory`'s buffer, to read only; next, laid out like it, holds garbage until
        written and becomes the slot's memory when the exchange succeeds (the inf/NaN guard
        then needs no copy of it to undo the step, and nothing is copied back). next may be
        current itself (a context without double buffering): write an element of next only
        after the last read of current's element there."""

    def verdict(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The inf/NaN guard's (flag, clear), for a last kernel that writes every element of
        the result ``out``: out NaN throughout where flag[0] > 0, clear[0] = 0 (the guard's
        kernels.flag_fill, then left out). None where the guard offers none. Called after
        the exchange's last collective."""

    def scalars(self, slot: str) -> torch.Tensor:
        """Persistent fp32 buffer of one value per parameter, in ``params`` order, zero at
        first use, kept per parameter (a bucket's per-parameter scalars in one tensor)."""

    def tensor(self, slot: str, name: str, init: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Persistent per-parameter tensor of any shape, created by ``init`` at first use."""

    def segment_ids(self) -> torch.Tensor:
        """(numel,) int64: index into ``params`` of each element of x."""

    def param_values(self) -> torch.Tensor:
        """The parameters themselves, flat fp32 in x's layout."""

    def seed(self, stream: int, name: str) -> int:
        """A seed for this (step, parameter, rank, stream): reproducible, distinct per rank."""

    def log(self, key: str, value) -> None:
        """Record a per-step scalar (a 0-d tensor is fine: no host sync here); values logged
        by several buckets in one step are averaged."""


def name_seed(base: int, name: str) -> int:
    """A seed from a config seed and a parameter name, equal on every rank."""
    return (base * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@functools.lru_cache(maxsize=4096)
def exact_match(patterns: str, name: str) -> bool:
    """Whether ``name`` matches one of the "|"-separated fnmatch ``patterns``."""
    return any(fnmatch.fnmatchcase(name, p.strip()) for p in patterns.split("|") if p.strip())


class Compressor(ABC):
    Config: type[MethodConfig] = MethodConfig
    name: str = ""
    description: str = ""
    stateless: bool = False  # True: no memory to protect from inf/NaN (plain allreduce)
    # its messages on the wire, each declared once (compressors/wire.py: pack and unpack go
    # by it; docs/wire.md shows them); () for one allreduce of the bucket as it is
    messages: tuple = ()
    # the memory slot holding this rank's own compression error (x's layout), if any: with
    # diagnostics on, the state logs how much of each step's input (gradient + it) it keeps
    residual_slot: str | None = None
    # memory slots holding one value per parameter (ctx.scalars), not one per element
    scalar_slots: tuple = ()
    # with Adam/AdamW and adam="auto" (hooks/optimizer/adam.py): what the method exchanges once
    # Adam's second moment is frozen, "momentum" (Adam's first moment, 1-bit Adam's way) or
    # "freeze" (the gradient), as measured on the GPT workload (bench/RESULTS.md, "Accuracy with AdamW")
    adam_exchange: Adam = Adam.MOMENTUM
    # with Adam/AdamW: option defaults of their own where the measurements asked for them
    # (hooks/options.py's for_optimizer; the user's options win)
    adam_defaults: dict = {}
    # what the method's defaults measured against allreduce, each figure with its source:
    # "sgd_points", top-1 points on CIFAR-10 with momentum SGD (narrow ResNet-18, OneCycleLR,
    # 12 epochs, mean of 3 seeds; bench/RESULTS.md, "Accuracy with SGD"), and "adamw_gap_pct", {adam
    # exchange: validation loss above allreduce's, in percent} on the GPT with AdamW (2000
    # steps, mean of the seeds there; bench/RESULTS.md, "Accuracy with AdamW"). hooks/auto.py's candidates
    # and hooks/optimizer/'s warning read them; a method not measured has none
    measured: dict = {}

    def __init__(self, config: MethodConfig):
        self.config = config

    # whether the method applies the SGD optimizer's momentum and weight decay itself (DGC):
    # hooks/optimizer/ checks the optimizer at registration (momentum_options) and hands it
    # their values per step (attach_momentum)
    reads_momentum = False

    def attach_momentum(self, source) -> None:
        """``source.values(names)``: (momentum, nesterov, weight_decay) at this step, for a
        method with ``reads_momentum`` (hooks/optimizer/'s SGDMomentum)."""

    def unbind(self) -> None:
        """Detach what was attached (the state is closing)."""

    @classmethod
    def sharded_refusal(cls, config, decays: bool) -> str | None:
        """Why the method cannot run under FSDP on a 1-D mesh, where a rank holds only its
        shard of each parameter (``decays``: the optimizer decays weights), or None."""
        return None

    def reads_params(self, live) -> bool:
        """Whether :meth:`reduce` reads ``ctx.param_values()`` (with delayed averaging the
        state then hands it a copy taken at submit: the optimizer updates the parameters
        while the exchange runs)."""
        return False

    def live(self, names):
        """Values the method reads from the job at each step, taken when a bucket holding the
        parameters ``names`` is submitted, on the caller's thread (so the exchange never
        races with the optimizer): ``ctx.live`` in :meth:`reduce`. None: nothing."""
        return None

    def reduce(self, x: torch.Tensor, ctx: BucketContext) -> torch.Tensor:
        """Return the average over ranks of the (compressed) gradient x (fp32, flat).

        May overwrite x. Must issue the same collectives, in the same order and with the same
        sizes, on every rank. By default: the parameters below ``min_numel`` (``split``) ride
        along dense, a bucket with nothing larger is one plain allreduce, and the rest is
        :meth:`exchange`'s."""
        big, dense = self.split(ctx.params)
        if not big:
            return self.dense(x, ctx)
        return self.exchange(x, ctx, big, dense)

    def exchange(self, x: torch.Tensor, ctx: BucketContext, big: list, dense: list) -> torch.Tensor:
        """:meth:`reduce` for a bucket holding compressed parameters ``big`` and parameters sent
        dense ``dense``: a method implements this, or :meth:`reduce` itself."""
        raise NotImplementedError(f"{type(self).__name__} implements neither reduce nor exchange")

    def dense(self, x: torch.Tensor, ctx: BucketContext) -> torch.Tensor:
        """Plain fp32 allreduce average: small buckets and degenerate settings; the warm-up's
        steps in bf16, int8 or int4 where the state says so (``ctx.dense_wire``, the option)."""
        return dense_average(x, ctx, getattr(ctx, "dense_wire", None))

    def add_residual(self, x: torch.Tensor, ctx: BucketContext,
                     slot: str = RESIDUAL, decay: float = 1.0) -> torch.Tensor:
        """Error feedback's input: y = x + decay * this rank's memory ``slot`` (``decay``: the
        error feedback's decay, SparseLoCo's; 1 keeps all of it), written into the
        next memory's buffer (``memory_next``), which then keeps y less what is sent
        (the method's encoder: :func:`gradcomp.kernels.sparse_encode` for the sparse
        methods); x itself, unchanged, with
        ``error_feedback`` off. x is left as it was: the caller may read it again (at the
        dense parameters, whose memory is 0) and overwrite it with the result."""
        if not self.config.error_feedback:
            return x
        e, y = ctx.memory_next(slot)
        return torch.add(x, e, out=y) if decay == 1.0 else torch.add(x, e, alpha=decay, out=y)

    def compresses(self, name: str, shape: tuple) -> bool:
        """Whether parameter ``name`` of this shape goes compressed (False: sent exact)."""
        return not self.stateless and self.big(name, math.prod(shape))

    def big(self, name: str, size: int) -> bool:
        """The size rule: at least ``min_numel`` elements (and one), not named in ``exact``."""
        return size >= max(self.config.min_numel, 1) and not exact_match(self.config.exact, name)

    def split(self, params) -> tuple[list[ParamSlice], list[ParamSlice]]:
        """(compressed, sent dense): parameters below ``min_numel`` elements, or named in
        ``exact``, go uncompressed."""
        big = [p for p in params if self.big(p.name, p.size)]
        return big, [p for p in params if not self.big(p.name, p.size)]


def dense_average(x: torch.Tensor, ctx, wire: str | None) -> torch.Tensor:
    """The average of x over ``ctx.comm``'s ranks with ``wire`` on the wire: "bfloat16",
    "int8" or "int4" (rows.py: the rows DiLoCo sends too), else a plain fp32 allreduce."""
    if wire == "bfloat16":
        return dense_bf16(x, ctx.comm)
    if wire in ("int8", "int4"):
        return dense_rows(x, ctx.params, ctx.comm, 8 if wire == "int8" else 4)
    return ctx.comm.allreduce(x).div_(ctx.comm.world_size)


@functools.lru_cache(maxsize=256)
def positions(layout: tuple, device) -> torch.Tensor:
    """int64 positions in the bucket of the elements of ``layout`` ((offset, numel) pairs),
    laid end to end: one gather or scatter moves them all (cached per layout)."""
    idx = [torch.arange(off, off + n, dtype=torch.int64) for off, n in layout]
    return (torch.cat(idx) if idx else torch.zeros(0, dtype=torch.int64)).to(device)


# at most this many runs go by runs (one cat of as many pieces plus the gaps, and a Python
# list of them per move); layouts of more go by per-element indices
MAX_RUNS = 4096


class Runs:
    """Contiguous runs of one flat layout laid into another, in ONE ``torch.cat``: a plan
    built once per layout, then per call a split of the source into views and one copy of
    the destination's every element (what no run covers is written 0). Against an
    ``index_select``/``index_copy_`` by an int64 position per element it reads no index and
    copies whole runs: measured 8 against 31-35 ms for ResNet-18's 11.2M elements on one CPU
    thread (1-bit's part layout, W = 2).

    ``runs``: (source start, destination start, length) triples; the destination ranges must
    not overlap, nor the source ranges."""

    def __init__(self, runs, src_len: int, dst_len: int):
        runs = sorted((d, s, n) for s, d, n in runs if n > 0)
        for d, s, n in runs:
            if min(d, s) < 0 or s + n > src_len or d + n > dst_len:
                raise ValueError(f"run of {n} from {s} to {d} lies outside the source "
                                 f"({src_len}) or the destination ({dst_len})")
        cuts = sorted({0, src_len} | {s for _, s, _ in runs} | {s + n for _, s, n in runs})
        self.sizes = [b - a for a, b in zip(cuts, cuts[1:])]
        piece = {a: i for i, a in enumerate(cuts[:-1])}
        plan, at = [], 0
        for d, s, n in runs:
            if d < at or piece.get(s) is None or self.sizes[piece[s]] != n:
                raise ValueError(f"runs overlap at destination {d} or source {s}")
            if d > at:
                plan.append(at - d)  # -gap: that many zeros
            plan.append(piece[s])
            at = d + n
        if at < dst_len:
            plan.append(at - dst_len)
        self.plan, self.dst_len = plan, dst_len
        self.gap = max([-p for p in plan if p < 0], default=0)
        self._zeros = {}  # per dtype and device: the gaps' zero views, made once

    def __call__(self, src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (dst_len,) = the runs of src, zeros elsewhere; returns out. Two ops whatever the
        number of runs: a split of src into views, a cat."""
        if not self.plan:
            return out
        key = (src.dtype, src.device)
        gaps = self._zeros.get(key)
        if gaps is None:
            zeros = torch.zeros(self.gap, dtype=src.dtype, device=src.device)
            gaps = self._zeros[key] = [zeros[:-p] if p < 0 else None for p in self.plan]
        pieces = src.split(self.sizes)
        torch.cat([pieces[p] if z is None else z for p, z in zip(self.plan, gaps)], out=out)
        return out


def _positions(params, device) -> torch.Tensor:
    return positions(tuple((p.offset, p.numel) for p in params), torch.device(device))


def dense_bf16(x: torch.Tensor, comm) -> torch.Tensor:
    """The average of x over ranks with bf16 on the wire and fp32 sums: x rounded to bf16
    once, cut into W parts; an all-to-all hands each rank every rank's copy of its part, which
    it sums in fp32 (rank order) and rounds to bf16 once; an allgather returns the parts.
    Half the bytes of an fp32 allreduce at any W, two roundings, no bf16 accumulation; every
    rank gets the same values. The bf16 travels as bytes (no arithmetic on the wire)."""
    W, n = comm.world_size, x.numel()
    part = -(-n // W)
    y = torch.zeros(W * part, dtype=torch.bfloat16, device=x.device)
    y[:n] = x
    if W == 1:
        return y[:n].float()
    got = comm.all_to_all(y.view(torch.uint8).view(W, 2 * part)).view(torch.bfloat16)
    mine = got.float().sum(0).div_(W).to(torch.bfloat16)
    every = comm.allgather(mine.view(torch.uint8)).view(torch.bfloat16)
    return every.reshape(-1)[:n].float()


def dense_values(x: torch.Tensor, params) -> torch.Tensor:
    """The elements of ``params`` in x, laid end to end (to ride along in a message)."""
    if not params:
        return x.new_zeros(0)
    return x.index_select(0, _positions(params, x.device))


def put_dense(rows: torch.Tensor, params, out: torch.Tensor) -> None:
    """out[param] = (sum over ranks of rows (W, m)) / W for the ``params`` packed by
    :func:`dense_values`: the same arithmetic as :meth:`Compressor.dense`, so a parameter's
    result does not depend on whether its bucket went dense as a whole. ``rows`` may be the
    raw bytes of a uint8 message."""
    if not params:
        return
    rows = rows.contiguous().view(torch.float32)
    total = sum_ranks(rows)  # in rank order
    out.index_copy_(0, _positions(params, out.device), total.div_(rows.shape[0]))


def zero_dense(e: torch.Tensor, params) -> None:
    """Parameters sent exactly keep no error: zero their elements of the memory e."""
    if params:
        e.index_fill_(0, _positions(params, e.device), 0.0)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config: type[MethodConfig]
    compressor: type[Compressor]
    description: str


METHODS: dict[str, MethodSpec] = {}


def register_method(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make a compressor available by its ``name``."""
    if not cls.name or cls.name in METHODS:
        raise ValueError(f"method name {cls.name!r} is empty or already registered")
    if "prepare" in vars(cls):
        raise TypeError(f"{cls.__name__}.prepare: no longer called (what a method takes from "
                        f"the optimizer is gradcomp.hooks.optimizer's, e.g. "
                        f"momentum_options for reads_momentum); remove it")
    METHODS[cls.name] = MethodSpec(cls.name, cls.Config, cls, cls.description)
    return cls


def build(method: str, config: MethodConfig | None = None) -> tuple[MethodConfig, Compressor]:
    """``method``'s config (its defaults where None) and a compressor built from it; a
    ValueError names an unknown method, a TypeError a config of another method's class."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: allowed {', '.join(sorted(METHODS))}")
    spec = METHODS[method]
    config = config if config is not None else spec.config()
    if not isinstance(config, spec.config):
        raise TypeError(f"method {method!r} takes a {spec.config.__name__}, "
                        f"got {type(config).__name__}")
    return config, spec.compressor(config)
