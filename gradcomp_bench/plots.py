"""Figures from the JSON the benchmarks write, with matplotlib (Agg: no display needed).

Every ``gradcomp-bench`` command writes its JSON first and draws from it, so a figure can be
redrawn later from a recorded run::

    python -m gradcomp_bench.plots bench/results/ddp_resnet18_100mbit.json --out bench/results

Each series gets its own colour, line style and marker, so no method hides another.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
          "tab:pink", "tab:gray", "tab:olive", "tab:cyan")
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h")


def styles():
    """(color, linestyle, marker) per series; the triple repeats only after 220 series."""
    for i in itertools.count():
        yield {"color": COLORS[i % len(COLORS)], "linestyle": LINESTYLES[i % len(LINESTYLES)],
               "marker": MARKERS[i % len(MARKERS)]}


def _figure(size=(10, 5.6)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas, whatever backend pyplot would pick
    return fig


def _finish(fig, ax, path, title, xlabel, ylabel):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.5)
    ax.grid(True, which="minor", alpha=0.15)
    handles, labels = ax.get_legend_handles_labels()
    if max(map(len, labels), default=0) <= 40:  # short names: beside the axes
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    else:  # long specs: below the axes, in two columns, the figure grown to hold them
        w, h = fig.get_size_inches()
        fig.set_size_inches(w, h + 0.16 * -(-len(labels) // 2))
        fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=7,
                   frameon=False)
    fig.savefig(path, dpi=110)
    return fig


def kind(doc) -> str:
    """Which benchmark wrote ``doc``: its ``kind`` field, or for older files their shape."""
    if isinstance(doc, dict) and "kind" in doc:
        return doc["kind"]
    if isinstance(doc, dict) and "curves" in doc:
        return "convergence"
    if isinstance(doc, dict) and doc.get("rows") and "step_s" in doc["rows"][0]:
        return "ddp"
    if isinstance(doc, dict) and doc.get("rows") and "exchanges" in doc["rows"][0]:
        return "overlap"
    raise ValueError("not the JSON of gradcomp-bench ddp, convergence or overlap")


def ddp(doc: dict, path):
    """Step time against link bandwidth for the first world size. Lines are projections,
    drawn as such: each method's measured non-communication time plus its bytes at that
    bandwidth, held at or above the compute-only step (``noop``, drawn as a measured
    horizontal line: no exchange makes a step faster than computing it); large hollow
    markers where a step was measured on a shaped link. A run the machine was too busy for
    (``machine.too_busy``) says so on the figure."""
    from .bench import project
    rows = doc["rows"]
    world = rows[0]["world"]
    bws = [10 ** (7 + i / 8) for i in range(33)]  # 10 Mbit/s .. 100 Gbit/s
    fig = _figure()
    ax = fig.add_subplot()
    seen = {}
    for r in rows:
        if r["world"] == world and r["method"] not in seen:
            seen[r["method"]] = [o for o in rows if o["world"] == world and o["method"] == r["method"]]
    floor = seen["noop"][0]["step_s"] if "noop" in seen else None
    any_measured = False
    for (method, mine), st in zip(seen.items(), styles()):
        if method == "noop":
            ax.axhline(floor * 1e3, color="black", linewidth=1.5,
                       label="noop: compute only (measured)")
            continue
        ax.plot(bws, [project(mine[0], b, floor) * 1e3 for b in bws],
                label=f"{method} (projected)", markevery=4, markersize=5, **st)
        measured = [(o["link_bps"], o["step_s"] * 1e3) for o in mine if o["link_bps"]]
        if measured:
            any_measured = True
            ax.plot(*zip(*measured), linestyle="none", marker=st["marker"], markersize=11,
                    markerfacecolor="none", markeredgecolor=st["color"], markeredgewidth=1.5)
    ax.set_xscale("log")
    ax.set_yscale("log")  # the 10 Mbit/s end is 30x the compute-only step
    if (doc.get("machine") or {}).get("too_busy"):
        ax.text(0.5, 0.5, "machine too busy to measure:\nthese lines rank nothing",
                transform=ax.transAxes, ha="center", va="center", fontsize=16, color="red",
                alpha=0.6)
    model = (doc.get("setup") or {}).get("model")
    where = ("large hollow markers: measured on the link" if any_measured else
             "measured on loopback only: every line is a projection")
    return _finish(fig, ax, path, f"step time vs link bandwidth, {world} ranks"
                   + (f", {model}" if model else "") + "\nlines: projected from each method's "
                   f"measured compute time and bytes, never below compute-only\n{where}",
                   "link bandwidth (bit/s)", "ms per step (log)")


def convergence(doc: dict, acc_path, loss_path):
    """Test accuracy and training loss (epoch mean) per optimizer step, one line per method."""
    curves = doc["curves"]
    figs = []
    for path, key, scale, title, ylabel in (
            (acc_path, "test_acc", 100, "CIFAR-10 test accuracy", "%"),
            (loss_path, "train_loss", 1, "CIFAR-10 training loss (epoch mean)", "loss")):
        fig = _figure()
        ax = fig.add_subplot()
        for (method, curve), st in zip(curves.items(), styles()):
            ax.plot([c["step"] for c in curve], [scale * c[key] for c in curve], label=method,
                    markersize=5, **st)
        figs.append(_finish(fig, ax, path, title, "optimizer step", ylabel))
    return figs


def lm_convergence(doc: dict, loss_path, bytes_path):
    """A language model's run: validation loss per step, one line per method; and the
    picture a user decides from, validation loss against the run's wire MB (log), one point
    per method (several documents' rows, e.g. seeds, are all drawn)."""
    fig = _figure()
    ax = fig.add_subplot()
    for (method, curve), st in zip(doc["curves"].items(), styles()):
        ax.plot([c["step"] for c in curve], [c["val_loss"] for c in curve], label=method,
                markersize=5, **st)
    _finish(fig, ax, loss_path, "validation loss (nats per character)", "optimizer step", "nats")
    fig = _figure()
    ax = fig.add_subplot()
    points = {}  # method -> its rows' (MB, loss): one style and one legend entry per method
    for r in doc["rows"]:
        if r.get("val_loss") is not None and r.get("wire_MB"):
            points.setdefault(r["method"], []).append((r["wire_MB"], r["val_loss"]))
    for (method, xy), st in zip(points.items(), styles()):
        ax.plot(*zip(*xy), label=method, markersize=9, **{**st, "linestyle": "none"})
    ax.set_xscale("log")
    return _finish(fig, ax, bytes_path, "validation loss against the bytes each rank sent over "
                   "the run (lower left is better)", "wire MB per rank per run (log)",
                   "validation loss (nats per character)")


def overlap(doc: dict, path):
    """One row per method: backward (grey; dark while gradients are computed) and each
    bucket's exchange on the communication thread (coloured), in ms."""
    rows = doc["rows"]
    fig = _figure((10, 1.2 + 0.6 * len(rows)))
    ax = fig.add_subplot()
    for i, r in enumerate(rows):
        b0, b1 = r["backward"]
        ax.broken_barh([(b0, b1 - b0)], (i - 0.4, 0.35), color="0.85",
                       label="backward returns" if i == 0 else None)
        ax.broken_barh([(b0, r["backward_ops_end"] - b0)], (i - 0.4, 0.35), color="0.55",
                       label="gradients computed" if i == 0 else None)
        ax.broken_barh([(s, max(e - s, 0.2)) for _, s, e in r["exchanges"]], (i + 0.05, 0.35),
                       facecolors=[COLORS[j % len(COLORS)] for j in range(len(r["exchanges"]))],
                       edgecolor="black", linewidth=0.3,
                       label="bucket exchanges" if i == 0 else None)
    ax.set_yticks(range(len(rows)), [r["method"] for r in rows])
    ax.invert_yaxis()
    return _finish(fig, ax, path, "one backward per method: grey = backward, colour = each "
                   "bucket's exchange (communication thread)", "ms since backward began", "")


def plot(doc, out_dir) -> list[Path]:
    """Draw ``doc``'s figures into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    k = kind(doc)
    if k == "ddp":
        ddp(doc, out / "ddp_step_time.png")
        return [out / "ddp_step_time.png"]
    if k == "convergence" and any("val_loss" in r for r in doc["rows"]):
        lm_convergence(doc, out / "convergence_val_loss.png", out / "convergence_loss_vs_bytes.png")
        return [out / "convergence_val_loss.png", out / "convergence_loss_vs_bytes.png"]
    if k == "convergence":
        convergence(doc, out / "convergence_acc.png", out / "convergence_loss.png")
        return [out / "convergence_acc.png", out / "convergence_loss.png"]
    if k == "overlap":
        overlap(doc, out / "overlap_timeline.png")
        return [out / "overlap_timeline.png"]
    raise ValueError(f"no figure for kind {k!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradcomp_bench.plots", description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="a file gradcomp-bench ddp/convergence/overlap wrote")
    p.add_argument("--out", default=None, help="directory for the PNGs (default: the JSON's)")
    args = p.parse_args(argv)
    try:
        doc = json.loads(Path(args.json).read_text())
        paths = plot(doc, args.out or Path(args.json).parent)
    except (OSError, ValueError) as exc:
        print(f"gradcomp_bench.plots: error: {exc}", file=sys.stderr)
        return 2
    print("plots: " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
