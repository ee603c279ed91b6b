"""The benchmarks behind ``gradcomp-bench``: end-to-end DDP step time per method and link,
and CIFAR convergence per method. Every number comes from a real run."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict

import torch

from .launch import spawn
from .train import TrainConfig, parse_method, train


def run_train(world: int, cfg: TrainConfig, link=None, timeout: float | None = 1800,
              per_node: int = 1) -> list[dict]:
    """Train ``cfg`` on ``world`` local ranks (inside ``link``'s namespaces when given, one per
    node of ``per_node`` ranks). ``timeout``: wall-clock limit in seconds (None: none). On a
    shaped link a collective may wait 300 s (ResNet-18's 45 MB of gradients take ~36 s to
    cross at 10 Mbit/s); on loopback 60 s."""
    return spawn(train, world, args=(asdict(cfg),), timeout=timeout, link=link,
                 per_node=per_node, pg_timeout=60 if link is None else 300)


# --------------------------------------------------------------------------- analysis
def model_bytes(model_name: str, rank: int = 2) -> tuple[int, int]:
    """(fp32 gradient bytes, bytes torch's PowerSGD rank-``rank`` hook sends) for a model."""
    from . import models
    net = models.build(model_name)
    raw, ps = 0, 0
    for p in net.parameters():
        raw += 4 * p.numel()
        if p.dim() >= 2:
            n, m = p.shape[0], p.numel() // p.shape[0]
            r = min(rank, n, m)
            ps += 4 * ((n + m) * r if n * m >= 2 * (n + m) * r else n * m)
        else:
            ps += 4 * p.numel()
    return raw, ps


def step_records(history: list[dict]) -> list[dict]:
    """One ``stats()`` record per exchange (the last of each): with ``local_steps``,
    ``stats()`` repeats the last outer round's record on every inner step (``step`` counts
    optimizer steps, ``rounds`` the outer exchanges)."""
    return list({h.get("rounds", h["step"]): h for h in history}.values())


def wire_bytes(method: str, res: dict, world: int, model_name: str) -> tuple[float, bool]:
    """Bytes per step on one rank's link: measured from state.stats() for gradcomp methods,
    computed from the model for torch's hooks (second value: True when measured)."""
    hist = res.get("stats_history")
    if hist:  # what crosses between nodes (under a hierarchy the rest stays inside a node)
        tail = hist[len(hist) // 2:]
        # a round's bytes are spread over all its steps
        return sum(r.get("inter_node_wire_bytes", r["wire_bytes"])
                   for r in step_records(tail)) / len(tail), True
    raw, ps = model_bytes(model_name)
    ring = 2 * (world - 1) / world
    name, opts = parse_method(method)
    cfg = res.get("config") or {}
    if cfg.get("parallel") == "fsdp" and name == "ddp":  # FSDP's reduce-scatter
        return (world - 1) / world * raw, False
    if cfg.get("parallel") == "hsdp" and name == "ddp":  # each shard's all-reduce across nodes
        L = cfg["ranks_per_node"]
        R = world // L
        return 2 * (R - 1) / R * raw / L, False
    if name == "noop":
        return 0.0, False
    if name == "fp16":
        return ring * raw / 2, False
    if name == "torch-powersgd":
        return ring * ps * opts["rank"] / 2, False
    return ring * raw, False


def _ratio(stats: dict) -> float:
    """Compression ratio: raw/sent bytes; under a hierarchy (dense bytes inside the node)
    what a flat ring allreduce would put on the link over what crosses between nodes."""
    if stats.get("intra_node_wire_bytes"):
        return stats["raw_wire_bytes"] / max(stats["inter_node_wire_bytes"], 1e-9)
    return stats["ratio"]


def summarize(method: str, res: dict, world: int, rate_bps: float | None, warmup: int,
              model_name: str) -> dict:
    t = sorted(res["step_times"][warmup:]) or sorted(res["step_times"])
    q = lambda f: t[min(len(t) - 1, int(f * len(t)))]  # noqa: E731
    wire, measured = wire_bytes(method, res, world, model_name)
    hist = res.get("stats_history") or []
    tail = hist[len(hist) // 2:]
    row = {"method": method, "world": world, "link_bps": rate_bps, "step_s": statistics.median(t),
           # the mean counts the rare slow steps the median hides (local_steps' outer rounds)
           "mean_s": statistics.mean(t),
           "p20_s": q(0.2), "p80_s": q(0.8), "wire_bytes": wire, "bytes_measured": measured,
           "ratio": _ratio(tail[-1]) if tail else None,
           "intra_node_bytes": statistics.mean(h.get("intra_node_wire_bytes", 0.0) for h in tail)
           if tail else 0.0,
           "codec_s": statistics.mean(h["codec_s"] for h in tail) if tail else None,
           # the codec's CPU time (codec_s is wall time, on cores shared with backward)
           "codec_cpu_s": statistics.mean(h.get("codec_cpu_s", math.nan) for h in tail)
           if tail else None,
           "comm_s": statistics.mean(h["comm_s"] for h in tail) if tail else None}
    ph = res.get("phases", [])[warmup:]
    for k in ("forward_s", "backward_s", "rest_s", "tail_s"):  # the step's split (train._phases)
        got = [p[k] for p in ph if k in p]
        row[k] = statistics.median(got) if got else None
    parallel = (res.get("config") or {}).get("parallel", "ddp")
    if row["ratio"] is None and wire > 0 and parallel == "ddp":
        # torch's hooks and DDP report no stats: fp32 allreduce's bytes against theirs
        row["ratio"] = 2 * (world - 1) / world * model_bytes(model_name)[0] / wire
    link_s = wire * 8 / rate_bps if rate_bps else 0.0
    row["nocomm_s"] = max(0.0, row["step_s"] - link_s)  # what is left without the wire time
    sizes = res.get("bucket_bytes")
    # the last bucket's share of the gradient (its exchange starts when backward has ended)
    row["last_bucket_share"] = sizes[-1] / sum(sizes) if sizes and sum(sizes) else None
    # delayed averaging: a step's exchanges run behind the next step, the last bucket's too
    row["delayed"] = bool(((res.get("config") or {}).get("options") or {}).get("delay"))
    return row


def _in_forwards(row: dict) -> float:
    """The row's step counted in forwards (the clock of the paced ratios)."""
    return row["step_s"] / row["forward_s"]


def finish(rows: list[dict]) -> None:
    """Add ratio to compute-only, the bound, and the break-even bandwidth vs allreduce."""
    for r in rows:
        same = [o for o in rows if o["world"] == r["world"] and o["link_bps"] == r["link_bps"]]
        noop = next((o for o in same if o["method"] == "noop"), None)
        base = next((o for o in same if o["method"] in ("ddp", "allreduce")), None)
        if noop:
            r["x_compute"] = r["step_s"] / noop["step_s"]
            r["x_compute_mean"] = r["mean_s"] / noop["mean_s"]
            link_s = r["wire_bytes"] * 8 / r["link_bps"] if r["link_bps"] else 0.0
            r["bound_s"] = noop["step_s"] + link_s
            r["x_bound"] = r["step_s"] / r["bound_s"]
            if r.get("forward_s") and noop.get("forward_s") and not r.get("delayed"):
                # paced by the forward, which no synchronous exchange touches: the step in
                # forwards against compute-only's (the machine's speed, which drifts by up to
                # 20% within minutes on a shared host, cancels; bench/RESULTS.md, "Speed on a slow link")
                r["x_paced"] = _in_forwards(r) / _in_forwards(noop)
            sync = next((o for o in same if o["method"] == "sync"), None)
            if sync and "x_paced" in r and sync.get("forward_s"):
                # paced against ``sync`` (compute-only + the wait for the slower rank, which
                # every synchronous exchange pays and compute-only does not)
                r["x_sync"] = _in_forwards(r) / _in_forwards(sync)
            share = r.get("last_bucket_share")
            if r.get("codec_cpu_s") is not None and share is not None:
                # the floor of this implementation on cores backward keeps busy: the codec's
                # CPU time adds, and so does the wire of the last bucket (nothing is left to
                # overlap it with); what a step takes beyond it is waiting
                r["floor_s"] = noop["step_s"] + r["codec_cpu_s"] + (
                    0.0 if r.get("delayed") else share * link_s)
                r["x_floor"] = r["step_s"] / r["floor_s"]
        if base and r is not base:
            dw = (base["wire_bytes"] - r["wire_bytes"]) * 8
            dc = r["nocomm_s"] - base["nocomm_s"]
            if dw <= 0:
                r["breakeven_bps"] = 0.0  # never ahead
            else:
                r["breakeven_bps"] = dw / dc if dc > 0 else math.inf


def combine_rounds(rows: list[dict], methods: list[str]) -> list[dict]:
    """The rows of a ``ddp --rounds`` run (each with its ``round``) as one row per method.

    Each round's rows get their ratios from :func:`finish` against that round's own noop
    (paired: a method and the compute-only step it is divided by ran minutes apart, not a
    whole run apart); a method's row then holds the median over rounds of each number,
    ratios included, its rounds' steps and ratios under ``rounds`` and the ratios' range as
    ``x_compute_lo`` / ``x_compute_hi``. One round: its rows as :func:`finish` leaves them."""
    by_round: dict[int, list[dict]] = {}
    for r in rows:
        by_round.setdefault(r.pop("round", 0), []).append(r)
    for rs in by_round.values():
        finish(rs)
    if len(by_round) == 1:
        return next(iter(by_round.values()))
    groups: dict[tuple, list[dict]] = {}
    for k in sorted(by_round):
        for r in by_round[k]:
            groups.setdefault((r["world"], r["link_bps"], r["method"]), []).append(r)
    order = {m: i for i, m in enumerate(methods)}
    out = []
    for (world, link, method), rs in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1] or 0, order.get(kv[0][2], len(order)))):
        row = dict(rs[0])
        for key, v in rs[0].items():
            vals = [r.get(key) for r in rs]
            if (key not in ("world", "link_bps") and not isinstance(v, bool)
                    and all(isinstance(x, (int, float)) for x in vals)):
                row[key] = statistics.median(vals)
        row["rounds"] = [{"step_s": r["step_s"], "x_compute": r.get("x_compute"),
                          "cpu_share": r.get("cpu_share")} for r in rs]
        ratios = [r["x_compute"] for r in rs if r.get("x_compute") is not None]
        if ratios:
            row["x_compute_lo"], row["x_compute_hi"] = min(ratios), max(ratios)
        out.append(row)
    return out


def project(row: dict, bps: float, floor: float | None = None) -> float:
    """Step time at another bandwidth from the measured non-communication time and bytes,
    held at ``floor`` or above (the compute-only step: no exchange makes a step faster than
    computing it; a non-communication time under it is the machine's noise)."""
    t = row["nocomm_s"] + row["wire_bytes"] * 8 / bps
    return t if floor is None else max(t, floor)


def cpu_share(results: list[dict], warmup: int) -> float | None:
    """The smallest share of a core any rank got over the measured steps (its CPU seconds
    per wall second; None where the ranks did not run on the CPU). Each rank's step is one
    thread's work: below ~1 other processes took the rest."""
    shares = []
    for res in results:
        cpu, wall = res.get("cpu_times"), res.get("step_times")
        if not cpu or not wall:
            continue
        cpu, wall = cpu[warmup:] or cpu, wall[warmup:] or wall
        if sum(wall) > 0:
            shares.append(sum(cpu) / sum(wall))
    return min(shares) if shares else None


# --------------------------------------------------------------------------- overlap
def profile_overlap(rank: int, world: int, method: str, model_name: str, batch: int,
                    steps: int = 4) -> dict:
    """Time one training step: when backward computed each bucket's gradients (the hook's
    call) and when each bucket's exchange ran on the communication thread. Exchange time
    before the last bucket was handed over ran while backward was still computing."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    import torch.nn.functional as F
    from . import data, models
    from .train import attach
    torch.manual_seed(0)
    net = models.build(model_name)
    model = DDP(net, broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = attach(model, method, opt)
    (x, y), _ = data.synthetic(n_train=batch * (steps + 1), n_test=1)
    for s in range(steps + 1):
        xb, yb = data.normalize(x[s * batch:(s + 1) * batch]), y[s * batch:(s + 1) * batch]
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        if s == steps:
            state.trace = []
            t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
    ev = state.trace
    state.trace = None
    ms = lambda t: (t - t0) * 1e3  # noqa: E731
    compute_end = max(e[3] for e in ev if e[0] == "submit")
    comm = [(f"bucket{b}", ms(a), ms(z)) for kind, b, a, z in ev if kind == "exchange"]
    return {"method": method, "backward": (0.0, ms(t1)), "backward_ops_end": ms(compute_end),
            "exchanges": comm,
            "overlapped_s": sum(max(0.0, min(z, ms(compute_end)) - a) for _, a, z in comm) / 1e3,
            "exchange_s": sum(z - a for _, a, z in comm) / 1e3}
