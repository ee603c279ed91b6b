"""Text tables and TensorBoard scalars for the benchmark CLI (figures: :mod:`.plots`)."""
from __future__ import annotations

import math
import textwrap


def _cells(row: dict, cols) -> list[str]:
    """A row's values formatted per column; missing values (None, NaN) as '-'."""
    out = []
    for key, _, fmt in cols:
        v = row.get(key)
        out.append("-" if v is None or (isinstance(v, float) and math.isnan(v))
                   else format(v, fmt) if fmt else str(v))
    return out


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """cols: (key, header, format). Missing values print as '-'."""
    cells = [[h for _, h, _ in cols]] + [_cells(r, cols) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    out = []
    for j, c in enumerate(cells):
        out.append("  ".join(s.rjust(w) if j and i else s.ljust(w)
                             for i, (s, w) in enumerate(zip(c, widths))).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def visible(rows: list[dict], cols: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The columns at least one row has a value in (a table of fixed columns stays narrow
    where a run measured less)."""
    return [c for c in cols if any(set(_cells(r, [c])) != {"-"} for r in rows)]


def reference_drift(rows: list[dict]) -> dict:
    """{(world, link_bps): how far the compute-only step (``noop``) moved during the run,
    relative to its median}: between its run before the others and its run after them
    (``step_after_s``), or across ``--rounds`` (the range of its rounds' steps); None where
    it was measured once."""
    out = {}
    for r in rows:
        if r["method"] != "noop":
            continue
        steps = [x["step_s"] for x in r.get("rounds") or []]
        if r.get("step_after_s") is not None:
            steps += [r["step_s"], r["step_after_s"]]
        out[(r["world"], r["link_bps"])] = (
            (max(steps) - min(steps)) / r["step_s"] if len(steps) > 1 and r["step_s"] else None)
    return out


def mark_noise(rows: list[dict]) -> None:
    """Mark (``within_noise``) each row whose ratio to compute-only says nothing: below 1 (no
    exchange makes a step faster than computing it; the machine's speed moved between the
    two runs), or nearer 1 than compute-only's own step moved during the run
    (:func:`reference_drift`, kept as ``reference_drift``)."""
    drift = reference_drift(rows)
    for r in rows:
        d = drift.get((r["world"], r["link_bps"]))
        if d is not None:
            r["reference_drift"] = d
        x = r.get("x_compute")
        if r["method"] == "noop" or x is None:
            continue
        r["within_noise"] = x < 1.0 or (d is not None and abs(x - 1.0) <= d)


# A compute-only (``noop``) rank is one thread of work per step (no exchange, one intra-op
# thread): with its core to itself its CPU time is its wall time; another 2-rank job on the
# same 2 cores would leave it about half; at load average 13 on the 2-core rig it got 11%. Under
# 0.8, other processes took over a fifth of the cores the ranks needed.
BUSY_CPU_SHARE = 0.8
# How far compute-only's own step may move between its runs before the ratios to it rank
# nothing: in the ResNet-18 runs RESULTS reports (ddp_resnet18_100mbit_s4*/s5*, latency_*)
# its rounds moved 4-17%.
BUSY_DRIFT = 0.2


def machine_check(rows: list[dict], cores_per_rank: float | dict = 1.0,
                  load: tuple | None = None) -> dict:
    """Whether the machine was quiet enough for ``rows`` (a ``ddp`` run's, after
    :func:`mark_noise`) to rank the methods: ``too_busy`` and its ``reasons``, from the
    compute-only runs: the smallest share of a core a rank got (``cpu_share``, against the
    ``cores_per_rank`` it could have: one figure, or one per world size), and how far the
    compute-only step moved between its
    runs (``reference_drift``). ``load``: the 1-minute load average before and after the run,
    kept to be shown (it counts the run's own ranks)."""
    shares, drifts = [], []
    for r in rows:
        if r["method"] != "noop":
            continue
        could = (cores_per_rank.get(r["world"], 1.0) if isinstance(cores_per_rank, dict)
                 else cores_per_rank)
        shares += [x / could for x in [r.get("cpu_share"), r.get("cpu_share_after")]
                   + [k.get("cpu_share") for k in r.get("rounds") or []] if x is not None]
        if r.get("reference_drift") is not None:
            drifts.append(r["reference_drift"])
    share = min(shares) if shares else None
    drift = max(drifts) if drifts else None
    reasons = []
    if share is not None and share < BUSY_CPU_SHARE:
        reasons.append(f"its compute-only ranks got {share:.0%} of the CPU time they could "
                       f"have (other processes took the rest)")
    if drift is not None and drift > BUSY_DRIFT:
        reasons.append(f"the compute-only step moved {drift:.0%} between its runs")
    out = {"too_busy": bool(reasons), "reasons": reasons, "cpu_share": share,
           "reference_drift": drift, "thresholds": {"cpu_share": BUSY_CPU_SHARE,
                                                    "reference_drift": BUSY_DRIFT}}
    if load is not None:
        out["load_before"], out["load_after"] = load
    return out


def busy_warning(machine: dict | None, width: int = 100) -> str | None:
    """The lines printed above a ``ddp`` table measured on a busy machine (None: quiet)."""
    if not machine or not machine.get("too_busy"):
        return None
    load = machine.get("load_before")
    return textwrap.fill(
        "WARNING: this machine was too busy to measure: " + "; ".join(machine["reasons"])
        + (f" (load average {load:.1f} before the run)" if load is not None else "")
        + ". The rows below do not rank the methods (a compressing method's codec competes "
        "with the other jobs for the cores): rerun when `uptime` shows a load average under "
        "the core count.", width=width)


def noise_note(rows: list[dict], mark: str = "*", more: bool = False) -> str | None:
    """The footnote for the rows :func:`mark_noise` marked (None: none; ``more``: other
    cells were marked too)."""
    if not more and not any(r.get("within_noise") for r in rows):
        return None
    moved = sorted({(r["world"], r["link_bps"], r["reference_drift"]) for r in rows
                    if r["method"] == "noop" and r.get("reference_drift") is not None},
                   key=lambda t: (t[0], t[1] or 0))
    where = ", ".join(f"{d:.0%} (W {w}, {'loopback' if b is None else f'{b / 1e6:g}mbit'})"
                      for w, b, d in moved)
    return textwrap.fill(
        f"{mark} within noise: below compute-only (no exchange makes a step faster than "
        f"computing it) or nearer to it than compute-only's own step moved during the run"
        + (f" ({where})" if where else "") + ". Rerun on a quiet machine, or with more --rounds.",
        width=100, subsequent_indent="  ")


def doc_seed(doc: dict) -> int:
    """The seed a convergence document was run with (its ``seed``, else its command line's
    ``--seed``, else the CLI's default 0)."""
    if "seed" in doc:
        return int(doc["seed"])
    argv = [str(a) for a in doc.get("argv", [])]
    for i, a in enumerate(argv):
        if a == "--seed" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--seed="):
            return int(a.split("=", 1)[1])
    return 0


def over_seeds(docs: list[dict], base: str = "allreduce") -> list[dict]:
    """One row per method over convergence documents of several seeds (rows of one seed may
    be spread over several documents): per-seed test accuracy, their mean, and the mean,
    min and max over seeds of the difference to ``base`` run with the same seed (seeds
    without a ``base`` row are left out of the differences), mean test loss and wire MB, and
    how many runs failed (rows with ``failed``, left out of the rest)."""
    by_seed: dict[int, dict[str, dict]] = {}
    failed: dict[str, int] = {}
    for doc in docs:
        rows = by_seed.setdefault(doc_seed(doc), {})
        for r in doc["rows"]:
            if r.get("test_acc") is None and r.get("val_loss") is None:  # failed: counted
                failed[r["method"]] = failed.get(r["method"], 0) + 1
                continue
            if r["method"] in rows:
                raise ValueError(f"method {r['method']!r} twice for seed {doc_seed(doc)}")
            rows[r["method"]] = r
    seeds = sorted(by_seed)
    methods = list(dict.fromkeys([m for s in seeds for m in by_seed[s]] + list(failed)))
    out = []
    for m in methods:
        got = {s: by_seed[s][m] for s in seeds if m in by_seed[s]}
        if not got:
            out.append({"method": m, "failed": failed[m]})
            continue
        key = "val_loss" if "val_loss" in next(iter(got.values())) else "test_acc"
        accs = [r[key] for r in got.values()]
        diffs = [r[key] - by_seed[s][base][key] for s, r in got.items() if base in by_seed[s]]
        wire = [r["wire_MB"] for r in got.values() if r.get("wire_MB") is not None]
        row = {
            "method": m, "seeds": ", ".join(str(s) for s in got),
            "per_seed": " / ".join(f"{a:.2f}" if key == "test_acc" else f"{a:.4f}" for a in accs),
            "mean_acc": sum(accs) / len(accs),
            "d_mean": sum(diffs) / len(diffs) if diffs else None,
            "d_min": min(diffs) if diffs else None, "d_max": max(diffs) if diffs else None,
            "wire_MB": sum(wire) / len(wire) if wire else None,
            "failed": failed.get(m),
        }
        if key == "test_acc":
            row["test_loss"] = sum(r["test_loss"] for r in got.values()) / len(got)
        else:  # relative to the base's mean, and how many times fewer bytes than it sent
            base_rows = [by_seed[s][base] for s in got if base in by_seed[s]]
            if base_rows:
                b = sum(r[key] for r in base_rows) / len(base_rows)
                row["d_pct"] = 100 * (row["mean_acc"] / b - 1)
                bw = [r["wire_MB"] for r in base_rows if r.get("wire_MB")]
                if bw and row["wire_MB"]:
                    row["x_fewer"] = (sum(bw) / len(bw)) / row["wire_MB"]
        out.append(row)
    return out


SEED_COLUMNS = [("method", "method", ""), ("seeds", "seeds", ""), ("per_seed", "test acc % per seed", ""),
                ("mean_acc", "mean", ".2f"), ("d_mean", "vs base (mean)", "+.2f"),
                ("d_min", "min", "+.2f"), ("d_max", "max", "+.2f"),
                ("test_loss", "test loss", ".3f"), ("wire_MB", "wire MB/run", ".1f"),
                ("failed", "runs failed", "d")]


LM_SEED_COLUMNS = [("method", "method", ""), ("seeds", "seeds", ""),
                   ("per_seed", "val loss per seed", ""), ("mean_acc", "mean", ".4f"),
                   ("d_mean", "vs base (mean)", "+.4f"), ("d_pct", "vs base %", "+.2f"),
                   ("d_min", "min", "+.4f"), ("d_max", "max", "+.4f"),
                   ("wire_MB", "wire MB/run", ".1f"), ("x_fewer", "x fewer bytes", ".1f"),
                   ("failed", "runs failed", "d")]


def markdown(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """The same table as :func:`table`, as Markdown."""
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_cells(r, cols)) + " |")
    return "\n".join(lines)


class Scalars:
    """TensorBoard scalars, or nothing when no directory is given (costs nothing when off)."""

    def __init__(self, log_dir):
        self.w = None
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.w = SummaryWriter(log_dir)

    def add(self, tag, value, step):
        if self.w is not None and value is not None:
            self.w.add_scalar(tag, float(value), step)

    def close(self):
        if self.w is not None:
            self.w.close()
