"""The narrow interface every method implements, and the registry that names them.

A method is a frozen config dataclass plus a :class:`Compressor` whose one job is
``reduce(x, ctx) -> average``: turn this rank's flat fp32 gradient ``x`` into the average
over ranks, moving compressed messages through ``ctx.comm``. Persistent per-parameter state
(residuals, velocities, low-rank factors) lives in ``ctx``, owned by the hook state, so the
compressor itself is stateless apart from its config and a new method is one small file.
"""
from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from ..config import MethodConfig


class Comm(Protocol):
    """Collectives on flat tensors; with world size 1 they are the identity."""

    world_size: int
    rank: int

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor: ...
    def allgather(self, t: torch.Tensor) -> torch.Tensor: ...
    def all_to_all(self, t: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class ParamSlice:
    name: str
    shape: tuple
    offset: int
    numel: int


class BucketContext(Protocol):
    """What a compressor sees of one bucket at one step (implemented by the hook state)."""

    comm: Comm
    step: int                 # optimizer steps completed before this one
    params: list[ParamSlice]  # layout of x
    relayout: bool            # True on the first step with this bucket's current layout

    def memory(self, slot: str) -> torch.Tensor:
        """Persistent fp32 flat buffer laid out like x, zero at first use, kept per parameter."""

    def tensor(self, slot: str, name: str, init: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Persistent per-parameter tensor of any shape, created by ``init`` at first use."""

    def segment_ids(self) -> torch.Tensor:
        """(numel,) int64: index into ``params`` of each element of x."""

    def param_values(self) -> torch.Tensor:
        """The parameters themselves, flat fp32 in x's layout."""

    def seed(self, stream: int) -> int:
        """A seed for this (step, bucket, rank, stream): reproducible, distinct per rank."""

    def log(self, key: str, value) -> None:
        """Record a per-step scalar (a 0-d tensor is fine: no host sync here)."""


def name_seed(base: int, name: str) -> int:
    """A seed from a config seed and a parameter name, equal on every rank."""
    return (base * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class Compressor(ABC):
    Config: type[MethodConfig] = MethodConfig
    name: str = ""
    description: str = ""

    def __init__(self, config: MethodConfig):
        self.config = config

    @abstractmethod
    def reduce(self, x: torch.Tensor, ctx: BucketContext) -> torch.Tensor:
        """Return the average over ranks of the (compressed) gradient x (fp32, flat).

        May overwrite x. Must issue the same collectives, in the same order and with the same
        sizes, on every rank."""

    def dense(self, x: torch.Tensor, ctx: BucketContext) -> torch.Tensor:
        """Plain fp32 allreduce average: small buckets and degenerate settings."""
        return ctx.comm.allreduce(x).div_(ctx.comm.world_size)

    def small(self, x: torch.Tensor) -> bool:
        return x.numel() < self.config.min_numel


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
    METHODS[cls.name] = MethodSpec(cls.name, cls.Config, cls, cls.description)
    return cls
