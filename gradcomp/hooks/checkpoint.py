"""Checkpoints: ``state_dict()`` holds everything a bit-exact resume needs (memory by
parameter name, the step counter, exchanges still owed); ``load_state_dict()`` refuses a
checkpoint of another method, options, world size or model with a message naming it.

The hook state (hooks/state.py) gathers its components' parts and its :class:`Identity`;
this module does the rest, one job each: the format (:func:`assemble`, :func:`tensor_digest`),
the checks of a checkpoint against an identity (:func:`check_checkpoint`), the collective
load (:func:`load`) and the adapters for frameworks' checkpoints
(:class:`DistributedCheckpoint`, :class:`AllRanksCheckpoint`).

A load is collective, as registration is (hooks/agree.py): every rank checks the checkpoint
it was given, all of it, before anything changes; then the ranks compare their verdicts and
the steps they load, and every rank loads or every rank raises, at the load itself."""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import math
import re
from typing import Callable

import torch
import torch.distributed as dist

from .. import comm
from ..config import MAX_STEPS, Adam, MethodConfig, quote
from .agree import agree
from .local_steps import ABSENT, SAVE_EACH_MODEL, check_local_state, same_model
from .optimizer import FROZEN_SLOT
from .schema import bad, check_int, check_names, check_plain, check_tensor
from .topology import SEP, base_name

# the layout of state_dict(); checkpoints without a "format" key are format 1 and load the same
# way; format 2 keeps local steps' outer momentum under "momentum" and its exchange in flight
# under "round" (local_steps.py reads both)
FORMAT = 3
# how long a load waits for every rank to call it (a rank that loads while the others train
# raises after it naming the ranks that did not come, its state unchanged): a load's ranks
# arrive within seconds of each other, and a rank left waiting holds the others up in their
# next exchange meanwhile
LOAD_TIMEOUT_S = 60.0
LOAD = ("gradcomp's load_state_dict",
        "every rank checks the checkpoint it was given, and a load is every rank's or none",
        "ranks loaded checkpoints of different steps (every rank loads its own state_dict() "
        "written at the same step)",
        "not every rank joined its agreement within gradcomp.hooks.checkpoint.LOAD_TIMEOUT_S seconds "
        "(this rank's state is unchanged; a rank that did not load trains on as before), or "
        "an earlier load's agreement failed so (loads into this state fail from then on: "
        "close() it and register anew)")
EXCHANGES = ("gradient", "momentum", "precondition")


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a checkpoint records of the state that writes it, and what a load compares with
    the state it loads into (hooks/state.py builds it): the method and its options, the
    world size, this rank (the job's: :func:`job_rank`), the ranks per node of a
    hierarchical topology (0: flat), the model's parameter names and their (or this rank's
    HSDP shards') sizes, the memory slots kept as one value per parameter, what the
    residuals are made of (:func:`exchanged`) and the Adam mode that runs; ``auto``:
    ``method="auto"`` chose the method. ``memory`` and ``rounds``: the components whose
    own tensors a load compares (their shapes, this rank's model)."""
    method: str
    config: MethodConfig
    world_size: int
    rank: int
    local_size: int
    names: tuple
    numels: dict
    scalar_slots: frozenset
    exchanges: str
    adam_running: str
    auto: bool
    memory: object
    rounds: object


def exchanged(mode: Adam) -> str:
    """What a method's residuals are made of, with Adam running ``mode`` (OFF: not bound):
    "gradient", Adam's first moment ("momentum") or the preconditioned gradient
    ("precondition")."""
    return mode.value if mode in (Adam.MOMENTUM, Adam.PRECONDITION) else "gradient"


def job_rank(rank: int) -> int:
    """The rank a checkpoint belongs to: the job's rank (under HSDP a state's group holds
    one shard's replicas, whose group ranks repeat across shards); ``rank`` without a job."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return rank


def assemble(me: Identity, step: int, parts: dict) -> dict:
    """The checkpoint of the state ``me`` at ``step``, from its components' own
    ``state_dict()`` (``parts``: memory, pending, local, warmup). ``format`` names this
    layout; ``rank`` the rank that wrote it (each rank's memory is its own: a checkpoint
    loads into the rank that wrote it); with local steps ``model_digest`` this rank's model
    (it differs from the others' in a round); ``digest`` a SHA-256 of every tensor, checked
    on load."""
    sd = {"format": FORMAT, "method": me.method, "config": me.config.to_dict(),
          "world_size": me.world_size, "rank": me.rank, "ranks_per_node": me.local_size,
          "step": step, **parts, "exchanges": me.exchanges}
    if me.rounds.active:
        sd["model_digest"] = me.rounds.digest()
    sd["digest"] = tensor_digest(sd)
    return sd


def tensor_digest(sd: dict) -> str:
    """SHA-256 over every tensor of a checkpoint (key path, dtype, shape, bytes), in key
    order: flipped bytes in a saved file do not load silently."""
    h = hashlib.sha256()

    def walk(path, v):
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                if k != "digest" or path:
                    walk(f"{path}/{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{path}/{i}", x)
        elif isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{path}|{t.dtype}|{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    walk("", sd)
    return h.hexdigest()


def check_checkpoint(sd, me: Identity) -> None:
    """Every check of a load, before anything is changed: raises naming the first problem.
    Everything a load hands to the state's components is checked here (types, sizes,
    shapes, ranges), so that a checkpoint that passes loads whole."""
    if not isinstance(sd, dict):
        raise TypeError(f"gradcomp checkpoint: expected the dict of state_dict(), got "
                        f"{type(sd).__name__}")
    fmt = sd.get("format", 1)
    if type(fmt) is not int or not 1 <= fmt <= FORMAT:
        raise bad("format", fmt, f"1 to {FORMAT} (this gradcomp writes {FORMAT})")
    missing = [k for k in ("method", "config", "world_size", "step", "memory") if k not in sd]
    if missing:
        raise ValueError(f"gradcomp checkpoint: missing key(s) {', '.join(missing)}: not a "
                         f"checkpoint of State.state_dict(), or a partial one")
    try:
        digest = tensor_digest(sd) if "digest" in sd else None
    except Exception as exc:  # noqa: BLE001  (a tensor whose bytes cannot be read)
        raise ValueError(f"gradcomp checkpoint: its tensors cannot be read back to check its "
                         f"digest ({type(exc).__name__}: {quote(str(exc), 200)}): the file "
                         f"was changed or damaged") from None
    if "digest" in sd and sd["digest"] != digest:
        raise ValueError("gradcomp checkpoint: its tensors do not match the digest saved with "
                         "them: the file was changed or damaged after it was written, or mixed "
                         "with another rank's (torch.distributed.checkpoint keeps one rank's "
                         "copy of equal keys: give DCP state.stateful(), not the state itself)")
    if not isinstance(sd["method"], str):
        raise bad("method", sd["method"], "a method's name")
    if not isinstance(sd["config"], dict):
        raise bad("config", sd["config"], "a dict of options")
    for k, v in sd["config"].items():
        if not isinstance(k, str):
            raise bad("a config key", k, "an option's name")
        check_plain(f"config option {k!r}", v)
    for key in ("world_size", "rank", "ranks_per_node"):
        if key in sd:
            check_int(key, sd[key], 0, 2**31)
    rank = me.rank
    if "rank" in sd and sd["rank"] != rank:
        raise ValueError(f"gradcomp checkpoint was written by rank {sd['rank']!r}; this is rank "
                         f"{rank} (torch.distributed.checkpoint takes state.stateful()): each "
                         f"rank's residuals are its own, so every rank saves and loads its own "
                         f"state_dict(), e.g. a file per rank")
    if sd.get("exchanges") is not None and sd["exchanges"] not in EXCHANGES:
        raise bad("exchanges", sd["exchanges"], f"None or one of {', '.join(EXCHANGES)}")
    check_int("step", sd["step"])
    _check_memory(sd["memory"], me)
    _check_pending(sd, me)
    _check_warmup(sd.get("warmup"))
    if me.rounds.active:
        check_local_state(sd.get("local"), me.config, me.numels, me.names)
    _check_compatible(me, sd)
    if me.rounds.active:
        _check_own_model(sd.get("model_digest"), me)


def _check_memory(mem, me: Identity) -> None:
    """A checkpoint's per-parameter memory: its slots, names, tensors, and the shapes of what
    the state holds already."""
    if not isinstance(mem, dict) or not isinstance(mem.get("flat"), dict) \
            or not isinstance(mem.get("tensors"), dict):
        raise bad("memory", type(mem).__name__, "a dict with 'flat' and 'tensors' dicts")
    for part in ("flat", "tensors"):
        for slot, d in mem[part].items():
            if not isinstance(slot, str):
                raise bad("a memory slot", slot, "a slot's name (a string)")
            check_names(f"memory slot {slot!r}", d)
            for name, t in d.items():
                check_tensor(f"memory slot {slot!r} of {name!r}", t)
                if slot == FROZEN_SLOT and (t.numel() != 1 or float(t) != int(t)
                                                   or not 1 <= int(t) <= MAX_STEPS):
                    raise bad(f"memory slot {slot!r} of {name!r}", t.tolist(),
                              f"one integer in [1, {MAX_STEPS}] (the Adam step v froze at)")
    for slot, d in mem["tensors"].items():
        for name, t in d.items():  # what the state holds already: the same shape and dtype
            mine = me.memory.find(slot, name)
            if mine is not None and (mine.shape != t.shape or mine.dtype != t.dtype):
                raise ValueError(f"checkpoint slot {slot!r} holds a {t.dtype} tensor of shape "
                                 f"{tuple(t.shape)} for parameter {name!r}; this state's is "
                                 f"{mine.dtype} of shape {tuple(mine.shape)}: a checkpoint of "
                                 f"another model (other shapes) or options")


def _check_pending(sd, me: Identity) -> None:
    """Delayed exchanges still owed: those of the ``delay`` steps before the checkpoint's."""
    pending = sd.get("pending", [])
    if not isinstance(pending, list):
        raise bad("pending", type(pending).__name__, "a list")
    step, D, known = sd["step"], me.config.delay, set(me.names)
    for i, p in enumerate(pending):
        if not isinstance(p, dict) or not isinstance(p.get("corrections"), dict):
            raise bad(f"pending[{i}]", p, "a dict with 'step' and 'corrections'")
        check_int(f"pending[{i}] step", p.get("step"), max(step - D, 0), max(step - 1, 0))
        check_names(f"pending[{i}] corrections", p["corrections"])
        for name, c in p["corrections"].items():
            if known and base_name(name) not in known:
                raise ValueError(f"gradcomp checkpoint: pending[{i}] holds a correction for "
                                 f"parameter {name!r}, which this model lacks")
            want = me.numels.get(name) if not me.local_size else None
            check_tensor(f"pending[{i}] correction of {name!r}", c, want)


def _check_warmup(wu) -> None:
    """The adaptive warm-up's window (hooks/warmup.py): its steps' per-parameter norms."""
    if wu is None:
        return
    if not isinstance(wu, dict) or not all(k in wu for k in ("entries", "next", "prev",
                                                             "ratio", "switch")):
        raise bad("warmup", wu, "a dict with entries, next, prev, ratio, switch")
    check_int("warmup next", wu["next"])
    if wu["switch"] is not None:
        check_int("warmup switch", wu["switch"])
    for key in ("prev", "ratio"):  # (a ratio is inf where the previous norm was 0)
        v = wu[key]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or math.isnan(v) or v < 0 or (key == "prev" and math.isinf(v))):
            raise bad(f"warmup {key}", v, "None or a number >= 0")
    if not isinstance(wu["entries"], list):
        raise bad("warmup entries", wu["entries"], "a list")
    for e in wu["entries"]:
        if not (isinstance(e, (list, tuple)) and len(e) == 3
                and isinstance(e[0], int) and not isinstance(e[0], bool) and 0 <= e[0] <= MAX_STEPS
                and isinstance(e[1], (list, tuple)) and all(isinstance(n, str) for n in e[1])
                and type(e[2]) is torch.Tensor and e[2].layout == torch.strided
                and not e[2].is_meta and e[2].dtype.is_floating_point
                and e[2].dim() == 1 and e[2].numel() == len(e[1])):
            raise bad("a warmup entry", e, "(step, parameter names, their squared norms: a "
                                           "1-D float tensor, one per name)")


def _check_own_model(saved, me: Identity) -> None:
    """Local steps: the model this rank holds at the load is the one its state was saved
    with (each rank's differs inside a round: rank 0's model loaded on every rank would
    resume every other rank from the wrong point)."""
    if saved is None:
        return
    if not (isinstance(saved, list) and all(isinstance(x, (list, tuple)) and len(x) == 2
                                            for x in saved)):
        raise bad("model_digest", saved, "a list of (sum, sum of squares) per parameter")
    mine = me.rounds.digest()
    if mine is not None and not same_model(saved, mine):
        raise ValueError(f"gradcomp checkpoint: the model this rank holds is not the one its "
                         f"gradcomp state was saved with (rank {me.rank}'s): "
                         f"{SAVE_EACH_MODEL}")


def load(read: Callable[[], dict], *, group, settle: Callable, identity: Callable[[], Identity],
         restore: Callable[[dict], None]) -> None:
    """The one load: every rank waits for its exchanges in flight (``settle()``, returning
    the error one of them raised, or None), reads its checkpoint (``read()``: the dict, or
    raises naming why there is none) and checks all of it against its state's
    ``identity()``; the ranks then compare their verdicts and steps over ``group`` (the
    loads' own: :func:`load_group`; hooks/agree.py) and every rank hands its checkpoint to
    ``restore``, or every rank raises (a rank refused: its error; the others: a ValueError
    quoting it). Loading into a state that has run steps is thus a fresh-process resume. A
    rank alone in a load (the others train on) raises after ``LOAD_TIMEOUT_S``, its state
    unchanged."""
    def build():
        failed = settle()
        if failed is not None:
            raise RuntimeError(f"gradcomp: an exchange of this state failed "
                               f"({quote(str(failed), 300)}): its ranks may have stopped "
                               f"at different points of it; close() the state, register anew "
                               f"and load into the new state")
        me = identity()
        sd = _own(read(), me.rank)
        check_checkpoint(sd, me)
        return sd, {"step": sd["step"]}

    if group is None or not dist.is_initialized():
        sd = build()[0]
    else:
        ranks = dist.get_process_group_ranks(group)
        _arrive(group, ranks)
        sd = agree(group, ranks, build, lambda _: None, what=LOAD)[0]
    restore(sd)


def load_group(members: list, made: list):
    """A process group of ``members`` for the loads' agreement, created
    with every other group of a registration (collective) and used by nothing else: a rank
    that loads while the others train waits here, not inside an exchange's collective (on
    a group the exchanges share, the two would meet as one collective: gloo aborts the
    process on such a size mismatch). gloo where it is built (a timeout raises there: NCCL's
    watchdog would end the process), with ``LOAD_TIMEOUT_S``."""
    g = dist.new_group(ranks=members, backend="gloo" if dist.is_gloo_available() else None,
                       timeout=datetime.timedelta(seconds=LOAD_TIMEOUT_S))
    made.append(g)
    return g


_LOADS: dict = {}  # a load group's name -> its loads so far on this rank (None: one failed)


def _arrive(group, ranks) -> None:
    """Every rank of ``group`` marks its arrival at this load in the job's store and waits
    for the others' marks (``LOAD_TIMEOUT_S``); a rank left waiting raises naming the ranks
    that did not come (those that loaded on one rank only, ``if rank == 0: load``), its state
    unchanged. Skipped where the job has no store to reach (the agreement's own timeout then
    ends the wait)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        name = group.group_name
    except (AttributeError, RuntimeError, ValueError):
        return
    n = _LOADS.get(name, 0)
    if n is None:
        raise RuntimeError("gradcomp: an earlier load into this state was not joined by every "
                           "rank, so the ranks' loads no longer pair up: close() the state, "
                           "register anew and load on every rank")
    _LOADS[name] = n + 1
    keys = [f"gradcomp/load/{name}/{n}/rank{r}" for r in ranks]
    store.set(keys[ranks.index(dist.get_rank())], "1")
    try:
        store.wait(keys, datetime.timedelta(seconds=LOAD_TIMEOUT_S))
    except Exception:  # noqa: BLE001  (the store's timeout: DistStoreError, RuntimeError)
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        if not missing:
            return
        _LOADS[name] = None
        raise RuntimeError(
            f"gradcomp's load_state_dict is collective (every rank loads its own checkpoint "
            f"at the same point), and rank(s) {', '.join(map(str, missing))} did not call it "
            f"within gradcomp.hooks.checkpoint.LOAD_TIMEOUT_S = {LOAD_TIMEOUT_S:g} s: call "
            f"load_state_dict on every rank, not under 'if rank == 0'. This rank's state is "
            f"unchanged") from None


_RANK_KEY = re.compile(r"rank\d+")


def _own(sd, rank: int):
    """This rank's dict of a checkpoint: ``sd`` itself, or from ``stateful()``'s form (each
    rank's ``state_dict()`` as bytes under ``rankN``) the bytes of this rank's, read."""
    if not (isinstance(sd, dict) and sd and "memory" not in sd
            and all(isinstance(k, str) and _RANK_KEY.fullmatch(k) for k in sd)):
        return sd
    key = f"rank{rank}"
    blob = sd.get(key)
    if not isinstance(blob, (bytes, bytearray)):
        raise ValueError(f"gradcomp: the distributed checkpoint holds no gradcomp state for "
                         f"{key} (found {quote(sorted(sd)[:4])}): save and load with the same "
                         f"ranks")
    try:
        return torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as exc:  # noqa: BLE001  (whatever unpickling raised: a damaged entry)
        raise ValueError(f"gradcomp: the distributed checkpoint's entry for {key} does not "
                         f"read back ({type(exc).__name__}: {quote(str(exc), 200)}): the "
                         f"file was damaged") from None


def _check_compatible(me: Identity, sd: dict) -> None:
    """Method, options, world size, topology and model: those of this state."""
    # options added since a checkpoint was written take their defaults, but those whose
    # default changes what a run does (local_steps.ABSENT) the value that run had; the
    # topology is compared as resolved (ranks per node), below, and the warm-up as the rule
    # that runs (a checkpoint's "adaptive" is today's "auto" at local_steps=1)
    config = me.config
    saved = {**type(config)().to_dict(), **ABSENT, **sd.get("config", {})}
    mine = config.to_dict()
    for k in ("topology", "local_size", "adam"):  # adam: as it runs, in _check_adam
        saved.pop(k), mine.pop(k)
    saved["warmup"] = type(config).warmup_rule_of(saved)
    mine["warmup"] = config.warmup_rule
    if sd.get("method") != me.method or saved != mine:
        auto = ""
        if me.auto and sd.get("method") != me.method:
            auto = (f"; method='auto' chose {me.method!r} in this job: to resume, register "
                    f"the method the checkpoint's job ran, {quote(sd.get('method'))}")
        if sd.get("method") != me.method:
            raise ValueError(f"checkpoint is for method {quote(sd.get('method'))}; this "
                             f"state runs {me.method!r}{auto}: register the method it was "
                             f"saved with to resume it")
        differ = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        shown = "; ".join(f"{k}: saved {quote(saved.get(k), 60)}, this state "
                          f"{quote(mine.get(k), 60)}" for k in differ[:8])
        more = f" and {len(differ) - 8} more" if len(differ) > 8 else ""
        raise ValueError(f"checkpoint of {me.method!r} was saved with other options than "
                         f"this state's: {shown}{more}; register with the options it was "
                         f"saved with to resume it")
    _check_adam(me, sd)
    if sd.get("world_size") != me.world_size:
        raise ValueError(f"checkpoint was saved with world size {sd.get('world_size')}; "
                         f"this job has {me.world_size}: residuals do not transfer")
    saved_local = sd.get("ranks_per_node", 0)
    if saved_local != me.local_size:
        def topo(n):
            return f"hierarchical with {n} ranks per node" if n else "flat"
        raise ValueError(f"checkpoint was saved with topology {topo(saved_local)}; this job "
                         f"runs {topo(me.local_size)}: its memory is kept per shard of "
                         f"that topology; set topology=/local_size= as when it was saved")
    _check_model_names(me, sd)


def _check_model_names(me: Identity, sd: dict) -> None:
    """The checkpoint's memory names this model's parameters (or this rank's HSDP shards of
    them), kept as this state keeps them, with their sizes."""
    known = set(me.names)
    unknown = memory_names(sd) - known if known else set()
    pieces = {n for n in me.numels if SEP in n}  # HSDP: this rank's shards
    saved_pieces = any(SEP in n for part in sd["memory"].values() for d in part.values()
                       for n in d)
    if saved_pieces and not (pieces or me.local_size) or (pieces and sd["memory"]["flat"]
                                                              and not saved_pieces):
        def kind(p):
            return "per shard (HSDP)" if p else "per whole parameter (DDP or 1-D FSDP)"
        raise ValueError(f"checkpoint holds memory {kind(saved_pieces)}; this state keeps "
                         f"it {kind(bool(pieces))}: resume with the parallelism it was "
                         f"saved with")
    if pieces:
        unknown |= {n for part in sd["memory"].values() for d in part.values() for n in d
                    if SEP in n and n not in pieces}
    if unknown:
        raise ValueError(f"checkpoint holds state for parameters this model lacks: "
                         f"{', '.join(sorted(unknown)[:5])}")
    for slot, d in sd["memory"]["flat"].items():
        scalar = slot in me.scalar_slots  # one value per parameter
        for name, v in d.items():
            want = me.numels.get(name)  # (a shard's piece: checked above)
            want = 1 if scalar and want is not None else want
            if want is not None and v.numel() != want:
                raise ValueError(f"checkpoint slot {slot!r} holds {v.numel()} elements for "
                                 f"parameter {name!r}; this model's has {want}")


def _check_adam(me: Identity, sd: dict) -> None:
    """A checkpoint with residuals loads only into a state that exchanges the same kind of
    values (:func:`exchanged`). Checkpoints written before the key existed ran adam="auto"
    as "freeze": the gradient."""
    if not any(sd["memory"]["flat"].values()):
        return
    saved = sd.get("exchanges")
    if saved is None:
        adam = sd.get("config", {}).get("adam", "auto")
        saved = "precondition" if adam == "precondition" else "gradient"
    mine = me.exchanges
    if saved != mine:
        how = {"gradient": "'freeze' (or without Adam: any)", "momentum": "'momentum'",
               "precondition": "'precondition'"}
        raise ValueError(f"checkpoint's residuals are of the {saved} (its job exchanged "
                         f"that); this job exchanges the {mine} (adam="
                         f"{str(me.config.adam)!r}, running "
                         f"{me.adam_running!r}): register with adam={how[saved]} "
                         f"to resume it")


def memory_names(sd: dict) -> set:
    """The parameters a checkpoint's memory is kept for (HSDP pieces by their parameter)."""
    return {base_name(n) for part in sd["memory"].values() for d in part.values() for n in d}


class DistributedCheckpoint:
    """A gradcomp.State as a ``torch.distributed.checkpoint`` Stateful (see ``stateful()``):
    ``save()`` is the state's ``state_dict()``, ``load(read)`` its collective load,
    ``rank()`` the job's rank (asked at each call)."""

    def __init__(self, save: Callable[[], dict], load: Callable, rank: Callable[[], int]):
        self._save, self._load, self._rank = save, load, rank

    def _key(self) -> str:
        return f"rank{self._rank()}"

    def state_dict(self) -> dict:
        buf = io.BytesIO()
        torch.save(self._save(), buf)
        return {self._key(): buf.getvalue()}

    def load_state_dict(self, sd: dict) -> None:
        def read():
            if not isinstance(sd, dict) or self._key() not in sd:
                raise ValueError(f"gradcomp: the distributed checkpoint holds no gradcomp "
                                 f"state for {self._key()} (found "
                                 f"{quote(sorted(sd)[:4] if isinstance(sd, dict) else sd)}): "
                                 f"save and load with state.stateful() and the same ranks")
            return sd
        self._load(read)


ALL_RANKS_FORMAT = "gradcomp-all-ranks-1"


class AllRanksCheckpoint:
    """A gradcomp.State as one object for a checkpoint written by rank 0 (see ``all_ranks()``):
    ``{"format", "world_size", "ranks": [state_dict() of rank 0, 1, ...]}`` with CPU tensors
    (loads with ``torch.load(weights_only=True)``). Ranks other than 0 return their own entry
    only (the others None): frameworks write rank 0's. ``save``, ``load``: as
    :class:`DistributedCheckpoint`'s."""

    def __init__(self, save: Callable[[], dict], load: Callable):
        self._save, self._load = save, load

    def state_dict(self) -> dict:
        buf = io.BytesIO()
        torch.save(self._save(), buf)
        world, rank = dist.get_world_size(), dist.get_rank()
        gathered = comm.gather_object(buf.getvalue())  # the default group: the caller's
        if rank != 0:
            gathered = [None] * world
            gathered[rank] = buf.getvalue()
        return {"format": ALL_RANKS_FORMAT, "world_size": world,
                "ranks": [None if b is None else torch.load(io.BytesIO(b), map_location="cpu",
                                                            weights_only=True) for b in gathered]}

    def load_state_dict(self, sd: dict) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()

        def read():  # (inside the load's agreement: a rank refused here refuses every rank)
            if not isinstance(sd, dict) or sd.get("format") != ALL_RANKS_FORMAT:
                found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
                raise ValueError(f"gradcomp: not a checkpoint of state.all_ranks() (format "
                                 f"{quote(found)}, expected {ALL_RANKS_FORMAT!r}); a single "
                                 f"rank's state_dict() loads with state.load_state_dict()")
            ranks = sd.get("ranks")
            if sd.get("world_size") != world or not isinstance(ranks, list) or len(ranks) != world:
                raise ValueError(f"gradcomp: the checkpoint holds the states of "
                                 f"{quote(sd.get('world_size'))} ranks; this job has {world}: "
                                 f"residuals do not transfer between world sizes")
            if ranks[rank] is None:
                writer = next((i for i, r in enumerate(ranks) if r is not None), "?")
                raise ValueError(f"gradcomp: the checkpoint holds no state for rank {rank}: it "
                                 f"was written by rank {writer} alone; load the file that "
                                 f"global rank 0 wrote")
            return ranks[rank]
        self._load(read)
