"""``gradcomp-bench report``: bench/RESULTS.md from the recorded rows, and README's method
table from the same rows (:func:`readme`).

The report is a function of two inputs: the rows in ``bench/results/**/*.json`` and the
hand-written spec ``bench/report.toml`` (which sections exist; per table the JSON files that
feed it, its kind, its figure, the command that produced the rows and a short fixed text of
what it shows). The same inputs give the same bytes: files are read in sorted order, rows
are ordered by fixed rules, numbers have fixed formats. A table kind is a function below,
registered in :data:`KINDS`; the spec picks one per table and the rows do the rest, so a new
JSON file that a table's glob matches (a new method's GPT runs, another seed) needs no code.

Kinds: ``runs`` (step-time runs of ``gradcomp-bench ddp --rounds``, one column of ratios per
run and their mean), ``single`` (rows of ``ddp`` runs as they are), ``seeds`` (convergence
runs, one row per method over seeds: :func:`gradcomp_bench.report.over_seeds`; with
``by_steps`` one table per step count and the specs with options apart from the defaults),
``kernels``, ``ops``, ``launches`` (bench/launches.py's GPU-path counts), ``plan``, ``plan_check``,
``longrun`` and ``syncs``.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import re
import statistics
import textwrap
import tomllib
from pathlib import Path

from . import report

SPEC = Path("bench/report.toml")
LIMIT_BYTES = 40_000


class SpecError(ValueError):
    """The spec names a file that is not there, or a kind or column that does not exist."""


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# --------------------------------------------------------------------------- inputs
def _entries(root: Path, files) -> list[tuple[Path, dict]]:
    """The spec's file list as (path, options), globs expanded in sorted order. An entry is
    a path or glob, or a table {path, only, drop, rename} (rename: method -> label)."""
    out = []
    for f in files:
        opts = {"path": f} if isinstance(f, str) else dict(f)
        paths = sorted(glob.glob(str(root / opts["path"]), recursive=True))
        if not paths:
            raise SpecError(f"no file matches {opts['path']!r}")
        out += [(Path(p), opts) for p in paths]
    return out


def _rows(rows: list[dict], opts: dict, key: str = "method") -> list[dict]:
    """Rows kept by an entry's ``only`` / ``drop``, relabelled by its ``rename``."""
    rename = opts.get("rename", {})
    out = []
    for r in rows:
        if "only" in opts and r[key] not in opts["only"]:
            continue
        if r[key] in opts.get("drop", ()):
            continue
        out.append({**r, key: rename.get(r[key], r[key])} if r[key] in rename else r)
    return out


def _load(path: Path):
    return json.loads(path.read_text())


def _argv_value(argv, name: str, default=None):
    argv = [str(a) for a in argv or []]
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _md(header: list[str], lines: list[list[str]]) -> str:
    """A Markdown table; a column with no value in any row ("-" throughout) is left out."""
    keep = [i for i in range(len(header)) if any(c[i] != "-" for c in lines)] if lines else []
    header, lines = [header[i] for i in keep], [[c[i] for i in keep] for c in lines]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(c) + " |" for c in lines]
    return "\n".join(out)


def _order(methods, first=(), key=None):
    """``first`` in its order, then the rest by ``key`` (then name)."""
    head = [m for m in first if m in methods]
    rest = sorted((m for m in methods if m not in head), key=lambda m: (key(m) if key else 0, m))
    return head + rest


# --------------------------------------------------------------------------- ddp rows
def paced_from_raw(doc: dict) -> dict[str, list[float]]:
    """Per method, its per-round paced ratios ((step / forward) against compute-only's of
    the same round, medians over the measured steps), from a ``ddp`` run's raw rows: what
    ``bench.finish`` stores as ``x_paced``, for runs whose rows predate it."""
    warm = int(_argv_value(doc.get("argv"), "--warmup", 4))
    per = {}
    for r in doc["raw"]:
        ph = [p["forward_s"] for p in r["phases"][warm:] if p.get("forward_s")]
        if not ph:
            continue
        per[(r["method"], r.get("round", 0))] = (statistics.median(r["step_times"][warm:])
                                                 / statistics.median(ph))
    out: dict[str, list[float]] = {}
    for (m, k), v in sorted(per.items(), key=lambda kv: kv[0][1]):
        if ("noop", k) in per:
            out.setdefault(m, []).append(v / per[("noop", k)])
    return out


def _run_metric(doc: dict, metric: str) -> dict[str, float]:
    """Each method's ``metric`` in one run (x_paced from the raw rows where the rows lack it)."""
    got = {r["method"]: r.get(metric) for r in doc["rows"]}
    if metric == "x_paced" and any(v is None for v in got.values()) and doc.get("raw"):
        raw = paced_from_raw(doc)
        got = {m: (v if v is not None else
                   statistics.median(raw[m]) if m in raw else None) for m, v in got.items()}
    return {m: v for m, v in got.items() if v is not None}


def kind_runs(t: dict, root: Path) -> str:
    """Several runs of one ``ddp`` job: per group of runs (``groups``: label, files, metric),
    every run's ratio and their mean; beside them the means over all runs of the step,
    the codec's CPU time, the floor (x compute-only), the wire bytes and the ratio
    (``columns``). Rows: ``first``, then by the last group's mean."""
    groups, rows_by_method, order_key = [], {}, {}
    for g in t["groups"]:
        runs = []
        for path, opts in _entries(root, g["files"]):
            doc = _load(path)
            doc["rows"] = _rows(doc["rows"], opts)
            runs.append(_run_metric(doc, g.get("metric", "x_compute")))
            noop = next((r for r in doc["rows"] if r["method"] == "noop"), None)
            for r in doc["rows"]:
                rows_by_method.setdefault(r["method"], []).append((r, noop))
        groups.append((g, runs))
    methods = list(rows_by_method)
    if "methods" in t:
        methods = [m for m in t["methods"] if m in rows_by_method]
    _, last_runs = groups[-1]
    for m in methods:
        order_key[m] = _mean([run.get(m) for run in last_runs]) or 0.0
    methods = _order(methods, t.get("first", ()), order_key.get)
    extras = t.get("columns", ["step_ms", "codec_cpu_ms", "floor", "wire_MB", "ratio"])
    header = ["method"]
    for g, runs in groups:
        header += [f"{g['label']} (run {', '.join(str(i + 1) for i in range(len(runs)))})",
                   f"{g['label']}, mean"] if len(runs) > 1 else [g["label"]]
    names = {"step_ms": "step ms", "codec_cpu_ms": "codec CPU ms/step",
             "floor": "floor (x compute)", "wire_MB": "wire MB/step", "ratio": "ratio"}
    header += [names[c] for c in extras]
    lines = []
    for m in methods:
        cells = [f"`{m}`"]
        for g, runs in groups:
            vals = [run.get(m) for run in runs]
            if len(runs) > 1:
                cells.append(" / ".join(_fmt(v, ".3f") for v in vals))
                cells.append(_fmt(_mean(vals), ".2f"))
            else:
                cells.append(_fmt(vals[0], ".2f"))
        pairs = rows_by_method[m]
        col = {
            "step_ms": _mean([r["step_s"] * 1e3 for r, _ in pairs]),
            "codec_cpu_ms": _mean([r.get("codec_cpu_s") and r["codec_cpu_s"] * 1e3
                                   for r, _ in pairs]),
            "floor": _mean([r["floor_s"] / n["step_s"] for r, n in pairs
                            if r.get("floor_s") and n]),
            "wire_MB": _mean([r.get("wire_bytes") and r["wire_bytes"] / 1e6 for r, _ in pairs
                              if m not in ("noop", "sync")]),
            "ratio": _mean([r.get("ratio") for r, _ in pairs]),
        }
        fmts = {"step_ms": ".0f", "codec_cpu_ms": ".0f", "floor": ".3f", "wire_MB": ".3f",
                "ratio": ".0f"}
        cells += [_fmt(col[c], fmts[c]) for c in extras]
        lines.append(cells)
    return _md(header, lines)


SINGLE_COLUMNS = {
    # key: (header, format, value from (row, the run's noop row, the table's first row))
    "step_ms": ("step ms", ".0f", lambda r, n, f: r["step_s"] * 1e3),
    "step_ms1": ("step ms", ".1f", lambda r, n, f: r["step_s"] * 1e3),
    "p20_p80": ("p20-p80 ms", "", lambda r, n, f: f"{r['p20_s'] * 1e3:.0f}-{r['p80_s'] * 1e3:.0f}"
                if r.get("p20_s") is not None else None),
    "x_compute": ("x compute-only", ".2f", lambda r, n, f: r.get("x_compute")),
    "x_compute_mean": ("x compute-only (mean step)", ".2f",
                       lambda r, n, f: r.get("x_compute_mean")),
    "cost_ms": ("codec's cost ms", "+.1f",
                lambda r, n, f: (r["step_s"] - n["step_s"]) * 1e3
                if n and r is not n and r["method"] not in ("noop", "allreduce", "ddp") else None),
    "faster": ("x faster than the first row", ".2f", lambda r, n, f: f["step_s"] / r["step_s"]),
    "wire_MB": ("wire MB/step", ".3f",
                lambda r, n, f: r.get("wire_bytes") and r["wire_bytes"] / 1e6),
    "ratio": ("ratio", ".1f", lambda r, n, f: r.get("ratio")),
    "codec_ms": ("codec ms/step", ".0f", lambda r, n, f: r.get("codec_s") and r["codec_s"] * 1e3),
}


def kind_single(t: dict, root: Path) -> str:
    """Rows of ``ddp`` runs as recorded (one or more files; each row's ratios against its
    own run's compute-only), the columns named by ``columns`` (:data:`SINGLE_COLUMNS`;
    ``headers`` overrides their names)."""
    rows = []
    for path, opts in _entries(root, t["files"]):
        doc = _load(path)
        noop = next((r for r in doc["rows"] if r["method"] == "noop"), None)
        rows += [(r, noop) for r in _rows(doc["rows"], opts)]
    if "methods" in t:
        pos = {m: i for i, m in enumerate(t["methods"])}
        rows = sorted((p for p in rows if p[0]["method"] in pos), key=lambda p: pos[p[0]["method"]])
    cols = t["columns"]
    for c in cols:
        if c not in SINGLE_COLUMNS:
            raise SpecError(f"column {c!r}: expected one of {', '.join(SINGLE_COLUMNS)}")
    heads = t.get("headers", {})
    labels = t.get("labels", {})
    header = ["method"] + [heads.get(c, SINGLE_COLUMNS[c][0]) for c in cols]
    first = rows[0][0]
    lines = []
    for r, n in rows:
        cells = [labels.get(r["method"], f"`{r['method']}`")]
        for c in cols:
            _, fmt, get = SINGLE_COLUMNS[c]
            v = get(r, n, first)
            cells.append("-" if v is None else v if isinstance(v, str) else format(v, fmt))
        lines.append(cells)
    return _md(header, lines)


# --------------------------------------------------------------------------- seeds
def _seed_docs(t: dict, root: Path) -> list[dict]:
    docs = []
    for path, opts in _entries(root, t["files"]):
        doc = _load(path)
        if "seed" not in doc and doc.get("rows") and "seed0" in doc["rows"][0]:
            # a table of seeds in one file (seedN columns, the test loss its mean): per seed
            seeds = sorted(int(k[4:]) for k in doc["rows"][0] if re.fullmatch(r"seed\d+", k))
            for s in seeds:
                docs.append({"seed": s, "rows": _rows(
                    [{"method": r["method"], "test_acc": r[f"seed{s}"], "test_loss": r["loss"],
                      "wire_MB": r.get("wire_MB")} for r in doc["rows"]
                     if r.get(f"seed{s}") is not None], opts)})
            continue
        doc["rows"] = _rows(doc["rows"], opts)
        docs.append(doc)
    return docs


def _seed_table(rows: list[dict], lm: bool, base: str) -> str:
    """over_seeds' rows as Markdown: every seed, the mean, the difference to ``base`` (its
    mean over seeds and the per-seed range; for a loss in % of ``base``'s mean), wire MB."""
    header = ["method", "seeds", ("val loss" if lm else "test acc %") + " per seed", "mean",
              f"vs {base}" + (" %" if lm else ""), "per-seed range", "test loss", "wire MB/run",
              "x fewer bytes"]
    keep = [True] * 6 + [not lm, True, lm]
    lines = []
    for r in rows:
        if "mean_acc" not in r:
            lines.append([f"`{r['method']}`", "-", f"{r['failed']} failed"] + ["-"] * 6)
            continue
        d, lo, hi = r.get("d_mean"), r.get("d_min"), r.get("d_max")
        if lm and r.get("d_pct") is not None:
            b = r["mean_acc"] / (1 + r["d_pct"] / 100)  # base's mean over the same seeds
            d, lo, hi = r["d_pct"], 100 * lo / b, 100 * hi / b
        rng = "-" if lo is None else f"{lo:+.2f} .. {hi:+.2f}"
        lines.append([f"`{r['method']}`", r["seeds"], r["per_seed"],
                      f"{r['mean_acc']:.4f}" if lm else f"{r['mean_acc']:.2f}",
                      _fmt(d, "+.2f"), rng, _fmt(r.get("test_loss"), ".3f"),
                      _fmt(r.get("wire_MB"), ".0f"), _fmt(r.get("x_fewer"), ".1f")])
    if any(r.get("failed") for r in rows):
        header.append("runs failed")
        keep.append(True)
        for r, cells in zip(rows, lines):
            cells.append(str(r.get("failed") or "-"))
    pick = lambda cells: [c for c, k in zip(cells, keep) if k]  # noqa: E731
    return _md(pick(header), [pick(c) for c in lines])


def kind_seeds(t: dict, root: Path) -> str:
    """Convergence runs over seeds, one row per method (``gradcomp-bench seeds``'s rows:
    every seed, the mean, the differences to ``base`` run with the same seed), ``base`` and
    ``first`` on top and the rest by their mean. With ``by_steps``: one table per step count
    (``--steps`` of each run), and the specs with options (``method:key=value``, other than
    ``base`` and ``baselines``) in a second table under ``base``'s row."""
    base = t.get("base", "allreduce")
    docs = _seed_docs(t, root)
    groups: dict[int | None, list[dict]] = {}
    for d in docs:
        steps = int(_argv_value(d.get("argv"), "--steps", 2000)) if t.get("by_steps") else None
        groups.setdefault(steps, []).append(d)
    out = []
    for steps in sorted(groups, key=lambda s: s or 0):
        rows = report.over_seeds(groups[steps], base)
        lm = any(r.get("val_loss") is not None for d in groups[steps] for r in d["rows"])
        sign = 1 if lm else -1
        key = {r["method"]: sign * r["mean_acc"] if "mean_acc" in r else 0.0 for r in rows}
        by_name = {r["method"]: r for r in rows}
        ordered = [by_name[m] for m in _order(list(by_name), [base, *t.get("first", ())], key.get)]
        parts = [ordered]
        if t.get("by_steps"):
            kept = (base, *t.get("baselines", ()))
            plain = [r for r in ordered if ":" not in r["method"] or r["method"] in kept]
            parts = [plain, [r for r in ordered if r not in plain]]
        for i, part in enumerate(parts):
            if not part:
                continue
            if steps is not None:
                what = "every method at its defaults" if i == 0 else "with options"
                out.append(f"{steps} steps, {what}:")
            top = [by_name[base]] if i and base in by_name else []
            out.append(_seed_table(top + part, lm, base))
    return "\n\n".join(out)


# --------------------------------------------------------------------------- kernels, ops, plan
def kind_kernels(t: dict, root: Path) -> str:
    """``gradcomp-bench kernels`` rows at one size: per step, a copy of its bytes, the
    reference, what the dispatcher runs (and its backend), its speed against the copy and
    the reference, and ``torch.topk`` where timed. A later file's rows replace an earlier's."""
    got: dict[tuple, dict] = {}
    for path, opts in _entries(root, t["files"]):
        for r in _rows(_load(path), opts, key="kernel"):
            if r["n"] == t["n"]:
                got[(r["kernel"], r["path"])] = r
    kernels = list(dict.fromkeys(k for k, _ in got))
    labels = t.get("labels", {})
    header = ["step", "copy ms", "reference ms", "dispatch ms (backend)", "dispatch vs copy",
              "vs reference", "`torch.topk` ms"]
    lines = []
    for k in kernels:
        ref, dis, cp, tk = (got.get((k, p))
                            for p in ("reference", "dispatch", "copy", "torch.topk"))
        lines.append([
            labels.get(k, k), _fmt(cp and cp["median_ms"], ".3f"),
            _fmt(ref and ref["median_ms"], ".3f"),
            f"{dis['median_ms']:.3f} ({dis['backend']})" if dis else "-",
            _fmt(dis and dis.get("vs_copy"), ".2f"),
            f"{ref['median_ms'] / dis['median_ms']:.1f}x" if ref and dis else "-",
            _fmt(tk and tk["median_ms"], ".3f")])
    return _md(header, lines)


def kind_ops(t: dict, root: Path) -> str:
    """``gradcomp-bench kernels --ops`` rows: per method and layout, the largest bucket's ops
    / kernel ops / GPU launches (launches where counted, unless the table's ``launches`` is
    false)."""
    rows = []
    for path, opts in _entries(root, t["files"]):
        rows += _rows(_load(path), opts)
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["layout"]): r for r in rows}
    names = t.get("layouts", {})
    lines = []
    for m in methods:
        cells = [f"`{m}`"]
        for lay in layouts:
            r = cell.get((m, lay))
            if r is None:
                cells.append("-")
                continue
            parts = [r["max_ops_per_bucket"], r["max_kernel_ops_per_bucket"]]
            if t.get("launches", True) and r.get("max_launches_per_bucket") is not None:
                parts.append(r["max_launches_per_bucket"])
            cells.append(" / ".join(str(p) for p in parts))
        lines.append(cells)
    return _md(["method"] + [names.get(lay, lay) for lay in layouts], lines)


def kind_launches(t: dict, root: Path) -> str:
    """``bench/launches.py`` rows: per method and layout, one bucket exchange's launches on
    the GPU's path."""
    rows = []
    for path, opts in _entries(root, t["files"]):
        rows += _rows(_load(path), opts)
    names = t.get("layouts", {})  # the layouts shown (all where not given), their names
    layouts = [lay for lay in dict.fromkeys(r["layout"] for r in rows) if not names or lay in names]
    cell = {(r["method"], r["layout"]): r["launches"] for r in rows}
    lines = [[f"`{m}`"] + [str(cell.get((m, lay), "-")) for lay in layouts]
             for m in dict.fromkeys(r["method"] for r in rows)]
    return _md(["method"] + [names.get(lay, lay) for lay in layouts], lines)


def _link(bps: float) -> str:
    return f"{bps / 1e9:g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:g} Mbit/s"


def kind_plan(t: dict, root: Path) -> str:
    """``gradcomp-bench plan`` rows: per rank count and link, each method's projected step
    against compute-only, the fastest in bold."""
    rows = []
    for path, opts in _entries(root, t["files"]):
        rows += _rows(_load(path)["rows"], opts)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["world"], r["link_bps"]), {})[r["method"]] = r["x_compute"]
    lines = []
    for (w, bps), c in sorted(cells.items()):
        best = min(c, key=lambda m: (c[m], m))
        lines.append([str(w), _link(bps)] + [
            "-" if m not in c else f"**{c[m]:.2f}x**" if m == best else f"{c[m]:.2f}x"
            for m in methods])
    return _md(["ranks", "link"] + [f"`{m}`" for m in methods], lines)


def kind_plan_check(t: dict, root: Path) -> str:
    """``gradcomp-bench plan --check`` rows: how many of the rig's rows the model predicts
    within ``within`` (0.15), over every recorded run and over the runs named in ``runs``."""
    within = t.get("within", 0.15)
    rows = []
    for path, opts in _entries(root, t["files"]):
        rows += _load(path)["rows"]

    def line(label, rs):
        ok = sum(abs(r["error"]) <= within for r in rs)
        lo, hi = min(r["error"] for r in rs), max(r["error"] for r in rs)
        return [label, str(len(rs)), str(ok), f"{lo:+.0%} .. {hi:+.0%}"]

    lines = [line("every recorded rig run", rows)]
    for label, names in t.get("runs", {}).items():
        rs = [r for r in rows if r["run"].split(":", 1)[0] in names]
        if not rs:
            raise SpecError(f"plan_check: no row of {names}")
        lines.append(line(label, rs))
    return _md(["runs", "rows", f"within {within:.0%}", "error"], lines)


def _longrun_summary(root: Path):
    path = root / "bench" / "longrun.py"
    spec = importlib.util.spec_from_file_location("gradcomp_bench_longrun", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.summary


def kind_longrun(t: dict, root: Path) -> str:
    """``bench/longrun.py``'s runs: per setting, rank 0's RSS at the base sample and at the
    end, its growth (in brackets the worst rank's), threads, open files, their spread over
    the samples (worst rank) and the wall time per step (``longrun.summary``)."""
    summary = _longrun_summary(root)
    docs = [_load(p) for p, _ in _entries(root, t["files"])]
    docs.sort(key=lambda d: (d["register_kwargs"] is None, d["setting"]))
    header = ["spec (`min_numel=0`)", "ranks", "steps", "RSS MiB at 1,000", "at the end",
              "growth (worst rank)", "OS / Python threads", "spread", "open fds", "spread",
              "ms per step"]
    lines = []
    for d in docs:
        s = summary(d)
        kw = {k: v for k, v in (d["register_kwargs"] or {}).items() if k != "min_numel"}
        name = d["spec"] if d["register_kwargs"] is None else f"`{d['spec']}`" + (
            " (" + ", ".join(f"{k}={v}" for k, v in sorted(kw.items())) + ")" if kw else "")
        lines.append([
            name, str(d["world"]), f"{d['steps']:,}", f"{s['rss_base']:.1f}",
            f"{s['rss_end']:.1f}", f"{s['rss_growth']:+.2f} ({s['rss_growth_any']:+.2f})",
            f"{s['os_threads']} / {s['py_threads']}",
            f"{s['os_threads_spread_any']} / {s['py_threads_spread_any']}", str(s["fds"]),
            str(s["fds_spread_any"]), f"{s['ms_per_step']:.1f}"])
    return _md(header, lines)


def kind_syncs(t: dict, root: Path) -> str:
    """``gpu_probe syncdebug`` (``bench/gpu_check.sh sync``): per method, the synchronizing
    calls ``torch.cuda.set_sync_debug_mode`` reported per compressed step under DDP and FSDP2
    and the library's source lines that made them ("-" where it did not compress)."""
    doc = _load(root / t["files"][0])
    rows = doc["rows"]
    methods = list(dict.fromkeys(k.split("/", 1)[1] for k in rows))
    lines = []
    for m in methods:
        cells = [f"`{m}`"]
        for adapter in ("ddp", "fsdp"):
            r = rows.get(f"{adapter}/{m}", {})
            compressed = r.get("compressing_since") is not None or m == "allreduce"
            cells += [_fmt(r.get("per_step") if compressed else None, ".2f"),
                      ", ".join(k.rsplit("/", 1)[-1] for k in r.get("where", {})
                                if k.startswith("gradcomp"))]
        lines.append(cells)
    return _md(["method", "DDP waits / step", "at", "FSDP2 waits / step", "at"], lines)


KINDS = {"runs": kind_runs, "single": kind_single, "seeds": kind_seeds,
         "kernels": kind_kernels, "ops": kind_ops, "launches": kind_launches, "plan": kind_plan,
         "plan_check": kind_plan_check, "longrun": kind_longrun,
         "syncs": kind_syncs}


# --------------------------------------------------------------------------- the report
def _text(s: str | None) -> str | None:
    return s.strip("\n") if s and s.strip() else None


def _table(t: dict, root: Path) -> list[str]:
    out = []
    if t.get("title"):
        out.append(f"### {t['title']}")
    out.append(_text(t.get("intro")))
    if t.get("kind"):
        if t["kind"] not in KINDS:
            raise SpecError(f"kind {t['kind']!r}: expected one of {', '.join(KINDS)}")
        out.append(KINDS[t["kind"]](t, root))
    for fig in t.get("figures", []):
        if not (root / "bench" / fig["path"]).is_file():
            raise SpecError(f"figure {fig['path']!r}: no such file under bench/")
        out.append(f"![{fig['alt']}]({fig['path']})")
    if t.get("files") or t.get("groups"):
        files = t.get("files") or [f for g in t["groups"] for f in g["files"]]
        paths = [f if isinstance(f, str) else f["path"] for f in files]
        out.append("Rows (`bench/results/`): " + ", ".join(
            f"`{p.removeprefix('bench/results/')}`" for p in dict.fromkeys(paths)) + ".")
    out.append(_text(t.get("text")))
    if t.get("command"):
        out.append("```\n" + t["command"].strip("\n") + "\n```")
    return [x for x in out if x]


def render(spec: dict, root: Path) -> str:
    """The report's Markdown from ``spec`` (a parsed bench/report.toml), paths under ``root``."""
    out = [f"# {spec['title']}", _text(spec.get("intro"))]
    out.append("\n".join(f"- [{s['title']}](#{slug(s['title'])})" + (
        f": {s['summary']}" if s.get("summary") else "") for s in spec["section"]))
    for s in spec["section"]:
        out.append(f"## {s['title']}")
        out.append(_text(s.get("intro")))
        for t in s.get("table", []):
            out += _table(t, root)
    return "\n\n".join(x for x in out if x) + "\n"


# --------------------------------------------------------------------------- README's table
README_BEGIN = ("<!-- written by `gradcomp-bench report` from bench/results and bench/report.toml "
                "([readme]): edit those, not this -->")
README_END = "<!-- end of what `gradcomp-bench report` writes -->"
FIGURE = re.compile(r"\{(\w+) (\S+) (\w+) (\S*?)(?: (min|max))?\}")


def _find_table(spec: dict, title: str) -> dict:
    for s in spec["section"]:
        for t in s.get("table", []):
            if t.get("title") == title:
                return t
    raise SpecError(f"[readme] source: no table titled {title!r} in the spec")


def source_values(t: dict, root: Path, steps: int | None = None) -> dict[str, dict]:
    """A RESULTS table's figures by method, from the same rows and the same rules as the
    table: ``seeds`` (:func:`report.over_seeds`' row: ``mean_acc``, ``d_mean``, ``d_pct``,
    ``x_fewer``, ``n_seeds``; ``steps`` picks a ``by_steps`` table's run length), ``runs``
    (each group's mean over its runs, under its metric's name) and ``single`` (every column
    of :data:`SINGLE_COLUMNS` of the method's first row)."""
    kind = t.get("kind")
    if kind == "seeds":
        docs = _seed_docs(t, root)
        if t.get("by_steps"):
            docs = [d for d in docs if int(_argv_value(d.get("argv"), "--steps", 2000)) == steps]
        out = {}
        for r in report.over_seeds(docs, t.get("base", "allreduce")):
            if "mean_acc" in r:
                out[r["method"]] = {**r, "n_seeds": len(r["seeds"].split(", "))}
        return out
    if kind == "runs":
        out: dict[str, dict] = {}
        for g in t["groups"]:
            runs = []
            for path, opts in _entries(root, g["files"]):
                doc = _load(path)
                doc["rows"] = _rows(doc["rows"], opts)
                runs.append(_run_metric(doc, g.get("metric", "x_compute")))
            for m in dict.fromkeys(m for run in runs for m in run):
                out.setdefault(m, {})[g.get("metric", "x_compute")] = _mean(
                    [run.get(m) for run in runs])
        return out
    if kind == "single":
        out = {}
        for path, opts in _entries(root, t["files"]):
            doc = _load(path)
            noop = next((r for r in doc["rows"] if r["method"] == "noop"), None)
            rows = _rows(doc["rows"], opts)
            for r in rows:
                out.setdefault(r["method"], {c: get(r, noop, rows[0])
                                             for c, (_, _, get) in SINGLE_COLUMNS.items()})
        return out
    raise SpecError(f"[readme] source: table {t.get('title')!r} is of kind {kind!r}; "
                    f"expected seeds, runs or single")


def readme_block(spec: dict, root: Path) -> str:
    """The README's part that ``spec["readme"]`` describes: its ``text`` with every figure
    ``{source method metric format}`` (or ``{source * metric format min|max}``: the least or
    greatest over the source's methods) filled from the named RESULTS table's rows; a figure
    the rows do not have is an error, never a blank."""
    rd = spec["readme"]
    values = {}
    for name, src in rd["sources"].items():
        values[name] = source_values(_find_table(spec, src["table"]), root, src.get("steps"))

    def fill(m: re.Match) -> str:
        name, method, metric, fmt, agg = m.groups()
        if name not in values:
            raise SpecError(f"[readme] {m.group(0)}: no source {name!r}; the sources are "
                            + ", ".join(values))
        if method == "*":
            got = [v[metric] for v in values[name].values() if v.get(metric) is not None]
            v = (min if agg == "min" else max)(got) if got and agg else None
        else:
            v = values[name].get(method, {}).get(metric)
        if v is None:
            raise SpecError(f"[readme] {m.group(0)}: the rows of {rd['sources'][name]['table']!r}"
                            f" have no {metric} for {method!r}")
        return format(v, fmt)

    # paragraphs are reflowed (a figure's width is the rows'); tables and lists stay as written
    parts = [p if p.lstrip().startswith(("|", "-", "<", "#", "```")) else
             textwrap.fill(" ".join(p.split()), width=96, break_on_hyphens=False,
                           break_long_words=False)
             for p in FIGURE.sub(fill, rd["text"].strip("\n")).split("\n\n")]
    return "\n\n".join(parts)


def readme(spec_path: Path, current: str) -> str | None:
    """``current`` (the README's text) with the part between :data:`README_BEGIN` and
    :data:`README_END` replaced by :func:`readme_block`; None where the spec has no
    [readme]."""
    spec_path = Path(spec_path).resolve()
    spec = tomllib.loads(spec_path.read_text())
    if "readme" not in spec:
        return None
    head, sep, rest = current.partition(README_BEGIN)
    _, sep2, tail = rest.partition(README_END)
    if not sep or not sep2:
        raise SpecError(f"the README lacks the lines {README_BEGIN!r} ... {README_END!r}")
    return (head + README_BEGIN + "\n\n" + readme_block(spec, spec_path.parent.parent)
            + "\n\n" + README_END + tail)


def build(spec_path: Path = SPEC) -> str:
    """The report for the spec at ``spec_path`` (the repository root is its parent's parent)."""
    spec_path = Path(spec_path).resolve()
    spec = tomllib.loads(spec_path.read_text())
    return render(spec, spec_path.parent.parent)
