"""``gradcomp-bench plan``: a cost model of a data-parallel step with each method, checked
against the rig's measurements and projected to clusters we do not have.

The model (per rank, per step; every term measured or computed, two overlap factors fitted):

    step = compute + ALPHA * codec + exposed(comm)
    comm = wire bytes * 8 / bandwidth + rounds * hops(W) * one-way latency

* ``compute``: the step without communication (the bench's ``noop`` row, or ``--compute-ms``).
* ``codec``: the method's CPU/GPU time compressing and decompressing one step's gradients.
  ALPHA of it adds to the step: on the CPU rig the ranks' backward already keeps the cores
  busy, so the codec's time adds, and a little more (the codec's thread slows backward by
  cache and memory traffic: ``bench/interference.py``).
* ``comm``: the link. DDP starts a bucket's exchange during backward, so BETA * compute of
  it hides behind compute (``exposed = max(0, comm - BETA * compute)``); with ``delay=1`` a
  step's exchange has the whole next step (``max(0, comm - compute)``); with ``local_steps=H``
  a round's codec and comm are spread over its H steps (and with ``local_delay=1`` hide behind
  H steps of compute).
* ``rounds``: collectives per step: DDP's buckets (its bucketing rule: 1 MB first, then
  25 MB) times the method's collectives per bucket (:data:`COLLECTIVES`); ``hops(W)``: the
  latency steps of one collective, ``2 ceil(log2 W)`` for an allreduce and ``ceil(log2 W)``
  for an allgather or all-to-all (tree / recursive-doubling schedules; a ring at W = 2).

ALPHA and BETA are :func:`fit` on one rig run (:data:`CALIBRATION`) and checked against
every other rig measurement by ``gradcomp-bench plan --check``. Each row's compute-only step
is taken at the pace the host ran that row (:func:`paced_compute`): this host's speed drifts
by up to 20% within a run.

Projection to W ranks (``gradcomp-bench plan --gpus 8,64,1024 --links 100mbit,...``): per
rank, the wire bytes of an allreduce-shaped method (allreduce, PowerSGD, 1-bit's two-phase
reduce) grow as ``2 (W - 1) / W``, those of an allgather-shaped one (top-k, DGC, threshold,
TernGrad) as ``W - 1``; the codec of an allgather-shaped method decodes W messages
(``codec(W) = codec(2) * (ENCODER_SHARE + (1 - ENCODER_SHARE) * W / 2)``). Hierarchical
topologies are not modelled (flat rings only).
"""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

# ALPHA: the share of the codec's time that adds to the step (above 1: the codec's thread
# also slows backward on the shared cores: bench/interference.py); BETA: the share of the
# compute time behind which DDP's in-backward exchanges hide. :func:`fit` on CALIBRATION's
# rows (grid of 0.05, least mean relative error; tests/test_plan.py checks these are its answer);
# GPU_ALPHA: on a GPU the codec runs on the same device as backward (not measured apart: all
# of it counted)
ALPHA, BETA, GPU_ALPHA = 1.05, 0.15, 1.0
# the first run of bench/RESULTS.md's "ResNet-18 on 100 Mbit/s, 2 ranks": every method in 3
# paired rounds, the forward recorded (the pace)
CALIBRATION = "bench/results/ddp_resnet18_100mbit_s49_rounds.json"

# collectives per bucket exchange (gradcomp/compressors/*: the ctx.comm calls)
COLLECTIVES = {"allreduce": ("allreduce",), "ddp": ("allreduce",), "fp16": ("allreduce",),
               "onebit": ("all_to_all", "allgather"), "powersgd": ("allreduce", "allreduce"),
               "terngrad": ("allreduce", "allgather"), "topk": ("allgather",),
               "dgc": ("allgather",), "threshold": ("allgather",)}
GATHER = {"terngrad", "topk", "dgc", "threshold"}  # bytes per rank grow as W - 1
ENCODER_SHARE = 0.9  # of an allgather-shaped codec at W = 2 (TernGrad's decoder: 83 of 910 ms)

# measured at W = 2 on ResNet-18 (bench/RESULTS.md): compression ratio against a ring
# allreduce's bytes (section 1f; dgc at 0.001 from section 1), codec ns per gradient element
# on this CPU (1 thread per rank, measured inside the rig's steps: onebit and powersgd from
# section 1j's new runs, topk and dgc from 1k's, threshold from 1l's, terngrad from 1m's; means
# of two runs) and on an H100 (section 5, "The GPU again": a ResNet-18 step at world size 1
# against compute-only, per element)
RATIO = {"allreduce": 1.0, "onebit": 16.8, "terngrad": 15.8, "topk": 9.9, "powersgd": 71.5,
         "dgc": 500.0, "threshold": 30.0}
CODEC_NS = {"cpu": {"allreduce": 0.0, "onebit": 44.5, "terngrad": 34.0, "topk": 30.5,
                    "powersgd": 27.0, "dgc": 17.5, "threshold": 17.0},
            "h100": {"allreduce": 0.0, "onebit": 0.30, "terngrad": 0.57, "topk": 0.35,
                     "powersgd": 0.18, "dgc": 0.36, "threshold": 0.60}}


@dataclass
class Case:
    """One step to predict."""

    method: str          # the method's name (no options)
    world: int
    compute_s: float
    codec_s: float       # per exchange round
    wire_bytes: float    # per rank per step (a round's bytes spread over its steps)
    link_bps: float
    latency_s: float = 0.0
    buckets: int = 1
    delay: bool = False
    local_steps: int = 1
    local_delay: bool = False
    alpha: float = ALPHA
    beta: float = BETA


def hops(kind: str, world: int) -> int:
    if world <= 1:
        return 0
    steps = math.ceil(math.log2(world))
    return 2 * steps if kind == "allreduce" else steps


def predict(c: Case) -> float:
    """The model's step seconds (see the module docstring)."""
    H = max(1, c.local_steps)
    rounds = [hops(k, c.world) for k in COLLECTIVES.get(c.method, ("allreduce",))]
    # one exchange round (every H steps): its bytes, its collectives' latency
    comm = H * c.wire_bytes * 8 / c.link_bps + c.buckets * sum(rounds) * c.latency_s
    if c.local_delay and H > 1:
        hidden = H * c.compute_s  # the next H steps' compute
    elif c.delay:
        hidden = c.compute_s
    else:
        hidden = c.beta * c.compute_s
    return c.compute_s + (c.alpha * c.codec_s + max(0.0, comm - hidden)) / H


def ddp_buckets(model_name: str, first_mb: float = 1.0, cap_mb: float = 25.0) -> int:
    """How many buckets DDP makes of the model's gradients (its rule: the parameters in
    reverse order, a first bucket of ``first_mb``, then ``cap_mb`` each)."""
    from . import models
    sizes = [4 * p.numel() for p in models.build(model_name).parameters()][::-1]
    n, fill, cap = 0, 0.0, first_mb * 2**20
    for s in sizes:
        if fill == 0.0:
            n += 1
        fill += s
        if fill >= cap:
            fill, cap = 0.0, cap_mb * 2**20
    return n


def _argv(d: dict) -> str:
    argv = d.get("argv") or []
    if isinstance(argv, str):
        argv = ast.literal_eval(argv)
    return " ".join(map(str, argv))


def _seconds(text: str | None) -> float:
    """A latency as ``ddp --latency`` takes it ('50ms', '100us', '0'); none: 0."""
    from .netlink import parse_time
    return parse_time(text) if text else 0.0


def _flag(argv: str, name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in a recorded command line."""
    m = re.search(rf"--{name}[ =](\S+)", argv)
    return m.group(1) if m else None


def _opt(spec: str, key: str) -> str | None:
    m = re.search(rf"(?:^|[:,]){key}=([^,]+)", spec)
    return m.group(1) if m else None


def paced_compute(row: dict, noop: dict, overlapped: bool) -> float:
    """The compute-only step at the pace the host ran ``row``'s steps: the noop row's step
    times the row's forward over the noop row's forward, where the rig recorded both.

    This host's speed drifts by up to 20% within one run (bench/RESULTS.md, "Speed on a slow
    link"), and a synchronous method's forward has no exchange in it, so its forward is the
    clock (the bench's ``x paced`` column). Not where an exchange overlaps the next steps
    (``delay=1``, ``local_delay=1``): there the forward shares the cores with the exchange."""
    fwd, noop_fwd = row.get("forward_s"), noop.get("forward_s")
    if overlapped or not fwd or not noop_fwd:
        return noop["step_s"]
    return noop["step_s"] * fwd / noop_fwd


def rig_cases(path: str | Path):
    """(Case, measured seconds, label) for each row of a ``gradcomp-bench ddp`` JSON that the
    model covers: the run's own compute-only step (paced, :func:`paced_compute`), codec
    seconds and wire bytes as inputs."""
    d = json.loads(Path(path).read_text())
    rows = d.get("rows") if isinstance(d, dict) else None
    if not rows:
        return []
    argv = _argv(d)
    lat = _seconds(_flag(argv, "latency"))
    run_delay = int(_flag(argv, "delay") or 0)
    buckets = ddp_buckets(_flag(argv, "model") or "resnet_small")  # the bench's default model
    out = []
    for r in rows:
        spec = r["method"]
        name = spec.split(":")[0]
        if name not in COLLECTIVES or not r.get("link_bps") or r.get("world", 2) < 2:
            continue
        # the compute-only step of the same world size and link (a run may sweep both)
        noop = next((o for o in rows if o["method"] == "noop" and o.get("world") == r.get("world")
                     and o.get("link_bps") == r.get("link_bps")), None)
        if noop is None:
            continue
        if _opt(spec, "topology") == "hierarchical" or (
                r.get("intra_node_bytes") or 0) > 0:
            continue  # the dense phases inside a node are not modelled
        codec = r.get("codec_s") if name not in ("ddp", "fp16") else 0.0
        if codec is None:
            continue
        H = int(_opt(spec, "local_steps") or 1)
        torch_hook = name in ("ddp", "fp16")  # the bench's --delay is for gradcomp's methods
        delay = not torch_hook and bool(run_delay or int(_opt(spec, "delay") or 0))
        local_delay = bool(int(_opt(spec, "local_delay") or 0))
        case = Case(name, r["world"], paced_compute(r, noop, delay or local_delay), codec,
                    r["wire_bytes"], r["link_bps"], lat, buckets, delay=delay,
                    local_steps=H, local_delay=local_delay)
        # with local steps the median is an inner step: the mean counts the rounds
        measured = r.get("mean_s", r["step_s"]) if H > 1 else r["step_s"]
        out.append((case, measured, f"{Path(path).name}: {spec}"))
    return out


def fit(paths, step: float = 0.05) -> tuple[float, float]:
    """(ALPHA, BETA) on a grid of ``step`` (ALPHA 0..2, BETA 0..1) with the least mean
    relative error over the rows of ``paths``; ties go to the smaller values."""
    cases = [(c, m) for p in paths for c, m, _ in rig_cases(p)]
    if not cases:
        raise ValueError(f"fit: no row the model covers in {', '.join(map(str, paths))}")
    best = None
    for i in range(int(round(2 / step)) + 1):
        for j in range(int(round(1 / step)) + 1):
            a, b = round(i * step, 10), round(j * step, 10)
            err = sum(abs(predict(dataclasses.replace(c, alpha=a, beta=b)) / m - 1)
                      for c, m in cases) / len(cases)
            if best is None or err < best[0] - 1e-12:
                best = (err, a, b)
    return best[1], best[2]


def check(paths) -> list[dict]:
    """Predicted against measured for every covered row of the given JSON files."""
    rows = []
    for p in paths:
        for case, measured, label in rig_cases(p):
            pred = predict(case)
            rows.append({"run": label, "world": case.world, "measured_s": measured,
                         "predicted_s": pred, "error": pred / measured - 1})
    return rows


def project(model_name: str, methods, worlds, links_bps, compute_s: float, device: str,
            latency_s: float = 0.0) -> list[dict]:
    """Projected step seconds per (method, world, link) from the tables above."""
    from .bench import model_bytes
    raw, _ = model_bytes(model_name)
    n = raw // 4
    buckets = ddp_buckets(model_name)
    codec_ns = CODEC_NS["cpu" if device == "cpu" else "h100"]
    alpha = ALPHA if device == "cpu" else GPU_ALPHA
    rows = []
    for m in methods:
        for W in worlds:
            for bps in links_bps:
                wire2 = raw / RATIO[m]  # per rank at W = 2 (a ring's 2 (W-1)/W = 1)
                wire = wire2 * ((W - 1) if m in GATHER else 2 * (W - 1) / W)
                codec = n * codec_ns[m] * 1e-9
                if m in GATHER:
                    codec *= ENCODER_SHARE + (1 - ENCODER_SHARE) * W / 2
                step = predict(Case(m, W, compute_s, codec, wire, bps, latency_s, buckets,
                                    alpha=alpha))
                rows.append({"method": m, "world": W, "link_bps": bps, "step_s": step,
                             "x_compute": step / compute_s})
    return rows
