"""Checkpoints: ``state_dict()`` holds everything a bit-exact resume needs (memory by
parameter name, the step counter, exchanges still owed); ``load_state_dict()`` refuses a
checkpoint of another method, options, world size or model with a message naming it."""
from __future__ import annotations

import hashlib
import io
import math

import torch
import torch.distributed as dist

from .. import comm
from .optimizer import FROZEN_SLOT
from .topology import SEP, base_name

# the layout of state_dict(); checkpoints without a "format" key (gradcomp <= 0.1) are format 1
# and load the same way
FORMAT = 2
_MAX_STEP = 2**53


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


def _bad(what: str, value, allowed: str) -> ValueError:
    text = repr(value)
    return ValueError(f"gradcomp checkpoint: {what} is {text[:80]}; allowed {allowed}")


def _check_int(what, v, low=0, high=_MAX_STEP):
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise _bad(what, v, f"an integer in [{low}, {high}]")


def _check_tensor(what, t, numel=None):
    if not isinstance(t, torch.Tensor):
        raise _bad(what, type(t).__name__, "a tensor")
    if not t.dtype.is_floating_point:
        raise _bad(f"{what}'s dtype", t.dtype, "a floating-point dtype")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"gradcomp checkpoint: {what} holds {t.numel()} elements; this model's "
                         f"parameter has {numel}")
    if not bool(torch.isfinite(t).all()):
        raise _bad(what, "a tensor holding inf/NaN", "finite values")


def check_checkpoint(sd, state) -> None:
    """Every check of a load, before anything is changed: raises naming the first problem."""
    if not isinstance(sd, dict):
        raise TypeError(f"gradcomp checkpoint: expected the dict of state_dict(), got "
                        f"{type(sd).__name__}")
    fmt = sd.get("format", 1)
    if fmt not in (1, FORMAT):
        raise _bad("format", fmt, f"1 or {FORMAT} (this gradcomp writes {FORMAT})")
    missing = [k for k in ("method", "config", "world_size", "step", "memory") if k not in sd]
    if missing:
        raise ValueError(f"gradcomp checkpoint: missing key(s) {', '.join(missing)}: not a "
                         f"checkpoint of GradcompState.state_dict(), or a partial one")
    if "digest" in sd and sd["digest"] != tensor_digest(sd):
        raise ValueError("gradcomp checkpoint: its tensors do not match the digest saved with "
                         "them: the file was changed or damaged after it was written, or mixed "
                         "with another rank's (torch.distributed.checkpoint keeps one rank's "
                         "copy of equal keys: save state.stateful(), not the state itself)")
    if not isinstance(sd["config"], dict):
        raise _bad("config", sd["config"], "a dict of options")
    rank = _rank(state)
    if "rank" in sd and sd["rank"] != rank:
        raise ValueError(f"gradcomp checkpoint was written by rank {sd['rank']!r}; this is rank "
                         f"{rank}: each rank's residuals are its own, so every rank saves and "
                         f"loads its own state_dict() (e.g. a file per rank, or "
                         f"torch.distributed.checkpoint)")
    _check_int("step", sd["step"])
    mem = sd["memory"]
    if not isinstance(mem, dict) or not isinstance(mem.get("flat"), dict) \
            or not isinstance(mem.get("tensors"), dict):
        raise _bad("memory", type(mem).__name__, "a dict with 'flat' and 'tensors' dicts")
    known = set(state.param_names.values())
    for part in ("flat", "tensors"):
        for slot, d in mem[part].items():
            if not isinstance(d, dict):
                raise _bad(f"memory slot {slot!r}", type(d).__name__, "a dict by parameter name")
            for name, t in d.items():
                _check_tensor(f"memory slot {slot!r} of {name!r}", t)
                if slot == FROZEN_SLOT and (t.numel() != 1 or float(t) != int(t)
                                                   or not 1 <= int(t) <= _MAX_STEP):
                    raise _bad(f"memory slot {slot!r} of {name!r}", t.tolist(),
                               f"one integer in [1, {_MAX_STEP}] (the Adam step v froze at)")
    pending = sd.get("pending", [])
    if not isinstance(pending, list):
        raise _bad("pending", type(pending).__name__, "a list")
    for i, p in enumerate(pending):
        if not isinstance(p, dict) or not isinstance(p.get("corrections"), dict):
            raise _bad(f"pending[{i}]", p, "a dict with 'step' and 'corrections'")
        _check_int(f"pending[{i}] step", p.get("step"))
        for name, c in p["corrections"].items():
            if known and base_name(name) not in known:
                raise ValueError(f"gradcomp checkpoint: pending[{i}] holds a correction for "
                                 f"parameter {name!r}, which this model lacks")
            want = state.param_numels.get(name) if not state.local_size else None
            _check_tensor(f"pending[{i}] correction of {name!r}", c, want)
    wu = sd.get("warmup")
    if wu is not None:
        if not isinstance(wu, dict) or not all(k in wu for k in ("entries", "next", "prev",
                                                                 "ratio", "switch")):
            raise _bad("warmup", wu, "a dict with entries, next, prev, ratio, switch")
        _check_int("warmup next", wu["next"])
        if wu["switch"] is not None:
            _check_int("warmup switch", wu["switch"])
        for key in ("prev", "ratio"):
            v = wu[key]
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or v < 0):
                raise _bad(f"warmup {key}", v, "None or a finite number >= 0")
        if not isinstance(wu["entries"], list):
            raise _bad("warmup entries", wu["entries"], "a list")
        for e in wu["entries"]:
            if not (isinstance(e, (list, tuple)) and len(e) == 3
                    and isinstance(e[2], torch.Tensor)):
                raise _bad("a warmup entry", e, "(step, parameter names, squared norms)")
    _check_compatible(state, sd)


def state_dict(state) -> dict:
    """Everything needed to resume ``state`` exactly, assembled from its components' own
    ``state_dict()``: memory by parameter name (memory.py), the step counter, the delayed
    exchanges still to be applied (delayed.py, waited for first), with local_steps the
    rounds' state (local_steps.py) and the adaptive warm-up's (warmup.py). ``format`` names
    this layout; ``rank`` the rank that wrote it (each rank's memory is its own: a
    checkpoint loads into the rank that wrote it); ``digest`` a SHA-256 of every tensor,
    checked on load."""
    state.drain()  # the exchanges in flight write the memory: first let them finish
    state.guard.settle()  # ... and a skipped step's leave no trace in it
    sd = {"format": FORMAT, "method": state.method, "config": state.config.to_dict(),
          "world_size": state.world_size, "rank": _rank(state),
          "ranks_per_node": state.local_size,
          "step": state.step, "memory": state.memory.state_dict(),
          "pending": state.delay.state_dict(),
          "local": state.rounds.state_dict(), "warmup": state.warmup.state_dict(),
          "exchanges": exchanged(state)}
    sd["digest"] = tensor_digest(sd)
    return sd


def load_state_dict(state, sd: dict) -> None:
    """Load a checkpoint of :func:`state_dict`: all of it, or (ValueError/TypeError naming
    what is wrong) nothing: every part is checked before the state is touched. Exchanges
    still in flight are waited for first, so loading into a state that has run steps is a
    fresh-process resume."""
    check_checkpoint(sd, state)
    state.drain()
    state.guard.settle()  # the copies it holds are of the memory being replaced
    restore(state, sd)


def restore(state, sd: dict) -> None:
    """Hand each component its part of a checked checkpoint."""
    state.memory.load_state_dict(sd["memory"])
    if state.adam is not None:
        state.adam.reset()
    state.resume_at(sd["step"])
    state.delay.load_state_dict(sd.get("pending", []))
    state.rounds.load_state_dict(sd.get("local"))
    state.warmup.load_state_dict(sd.get("warmup"))


def _check_compatible(state, sd: dict) -> None:
    """Method, options, world size, topology and model: those of this state."""
    # options added since a checkpoint was written take their defaults; the topology is
    # compared as resolved (ranks per node), below, and the warm-up as the rule that runs
    # (a checkpoint's "adaptive" is today's "auto" at local_steps=1)
    config = state.config
    saved = {**type(config)().to_dict(), **sd.get("config", {})}
    mine = config.to_dict()
    for k in ("topology", "local_size", "adam"):  # adam: as it runs, in _check_adam
        saved.pop(k), mine.pop(k)
    if saved["warmup"] == "auto":
        saved["warmup"] = "none" if saved["local_steps"] > 1 else "adaptive"
    mine["warmup"] = config.warmup_rule
    if sd.get("method") != state.method or saved != mine:
        auto = ""
        if state.method_probe is not None and sd.get("method") != state.method:
            auto = (f"; method='auto' chose {state.method!r} in this job: to resume, register "
                    f"the method the checkpoint's job ran, {sd.get('method')!r}")
        raise ValueError(f"checkpoint is for method {sd.get('method')!r} with {sd.get('config')}; "
                         f"this state runs {state.method!r} with {config.to_dict()}{auto}")
    _check_adam(state, sd)
    if sd.get("world_size") != state.world_size:
        raise ValueError(f"checkpoint was saved with world size {sd.get('world_size')}; "
                         f"this job has {state.world_size}: residuals do not transfer")
    saved_local = sd.get("ranks_per_node", 0)
    if saved_local != state.local_size:
        def topo(n):
            return f"hierarchical with {n} ranks per node" if n else "flat"
        raise ValueError(f"checkpoint was saved with topology {topo(saved_local)}; this job "
                         f"runs {topo(state.local_size)}: its memory is kept per shard of "
                         f"that topology; set topology=/local_size= as when it was saved")
    known = set(state.param_names.values())
    unknown = memory_names(sd) - known if known else set()
    pieces = {n for n in state.param_numels if SEP in n}  # HSDP: this rank's shards
    saved_pieces = any(SEP in n for part in sd["memory"].values() for d in part.values()
                       for n in d)
    if saved_pieces and not (pieces or state.local_size) or (pieces and sd["memory"]["flat"]
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
        scalar = slot in state.compressor.scalar_slots  # one value per parameter
        for name, v in d.items():
            want = state.param_numels.get(name)  # (a shard's piece: checked above)
            want = 1 if scalar and want is not None else want
            if want is not None and v.numel() != want:
                raise ValueError(f"checkpoint slot {slot!r} holds {v.numel()} elements for "
                                 f"parameter {name!r}; this model's has {want}")


def exchanged(state) -> str:
    """What the method's residuals are made of: "gradient", or with Adam bound Adam's first
    moment ("momentum") or the preconditioned gradient ("precondition")."""
    mode = state.adam_mode() if state.adam is not None else "off"
    return mode if mode in ("momentum", "precondition") else "gradient"


def _check_adam(state, sd: dict) -> None:
    """A checkpoint with residuals loads only into a state that exchanges the same kind of
    values (:func:`exchanged`). Checkpoints written before the key existed ran adam="auto"
    as "freeze": the gradient."""
    if not any(sd["memory"]["flat"].values()):
        return
    saved = sd.get("exchanges")
    if saved is None:
        adam = sd.get("config", {}).get("adam", "auto")
        saved = "precondition" if adam == "precondition" else "gradient"
    mine = exchanged(state)
    if saved != mine:
        how = {"gradient": "'freeze' (or without Adam: any)", "momentum": "'momentum'",
               "precondition": "'precondition'"}
        raise ValueError(f"checkpoint's residuals are of the {saved} (its job exchanged "
                         f"that); this job exchanges the {mine} (adam={state.config.adam!r}, "
                         f"running {state.adam_mode()!r}): register with adam={how[saved]} "
                         f"to resume it")


def memory_names(sd: dict) -> set:
    """The parameters a checkpoint's memory is kept for (HSDP pieces by their parameter)."""
    return {base_name(n) for part in sd["memory"].values() for d in part.values() for n in d}


def _rank(state) -> int:
    """The rank a checkpoint belongs to: the job's rank (under HSDP a state's group holds
    one shard's replicas, whose group ranks repeat across shards)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return state.rank


class DistributedCheckpoint:
    """A GradcompState as a ``torch.distributed.checkpoint`` Stateful (see ``stateful()``)."""

    def __init__(self, state):
        self.state = state

    def _key(self) -> str:
        return f"rank{_rank(self.state)}"

    def state_dict(self) -> dict:
        buf = io.BytesIO()
        torch.save(self.state.state_dict(), buf)
        return {self._key(): buf.getvalue()}

    def load_state_dict(self, sd: dict) -> None:
        key = self._key()
        blob = sd.get(key) if isinstance(sd, dict) else None
        if not isinstance(blob, (bytes, bytearray)):
            raise ValueError(f"gradcomp: the distributed checkpoint holds no gradcomp state for "
                             f"{key} (found {sorted(sd)[:4] if isinstance(sd, dict) else sd!r}): "
                             f"save and load with state.stateful() and the same ranks")
        self.state.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))


ALL_RANKS_FORMAT = "gradcomp-all-ranks-1"


class AllRanksCheckpoint:
    """A GradcompState as one object for a checkpoint written by rank 0 (see ``all_ranks()``):
    ``{"format", "world_size", "ranks": [state_dict() of rank 0, 1, ...]}`` with CPU tensors
    (loads with ``torch.load(weights_only=True)``). Ranks other than 0 return their own entry
    only (the others None): frameworks write rank 0's."""

    def __init__(self, state):
        self.state = state

    def state_dict(self) -> dict:
        buf = io.BytesIO()
        torch.save(self.state.state_dict(), buf)
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
        if not isinstance(sd, dict) or sd.get("format") != ALL_RANKS_FORMAT:
            found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"gradcomp: not a checkpoint of state.all_ranks() (format "
                             f"{found!r}, expected {ALL_RANKS_FORMAT!r}); a single rank's "
                             f"state_dict() loads with state.load_state_dict()")
        ranks = sd.get("ranks")
        if sd.get("world_size") != world or not isinstance(ranks, list) or len(ranks) != world:
            raise ValueError(f"gradcomp: the checkpoint holds the states of "
                             f"{sd.get('world_size')!r} ranks; this job has {world}: residuals "
                             f"do not transfer between world sizes")
        mine = ranks[rank]
        if mine is None:
            raise ValueError(f"gradcomp: the checkpoint holds no state for rank {rank}: it was "
                             f"written by rank {next((i for i, r in enumerate(ranks) if r is not None), '?')}"
                             f" alone; load the file that global rank 0 wrote")
        self.state.load_state_dict(mine)
