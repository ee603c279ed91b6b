"""Long runs: does a registered method hold its memory, threads and open files flat over
20,000 optimizer steps?

Each setting trains the tests' small MLP (``tests/conftest.py``'s ``small_net``: 20-64-48-10,
4954 parameters) on fixed random batches (16 per rank, 16 x 20 each, cycled) under DDP with
tiny buckets (``bucket_cap_mb=0.004``: three buckets per step, so several lanes work, and DDP
rebuilds them after the first step), SGD lr 0.01 momentum 0.9, and the method registered by
``gradcomp.register(model, spec, optimizer=opt, min_numel=0, ...)`` (``min_numel=0``: every
tensor is compressed; at the default 4096 this net would go as a plain allreduce);
``ddp_control`` is the same job with nothing registered. Every ``--every`` steps every rank
records its RSS (``/proc/self/statm``), its threads (``threading.active_count()`` and the OS
count, ``Threads:`` in ``/proc/self/status``), its open file descriptors (``/proc/self/fd``)
and the wall time, after a ``gc.collect()`` so that a sample does not depend on when the
cyclic collector last ran. One more sample is taken after ``state.close()``.

    python bench/longrun.py                       # every setting, 20,000 steps each (~20 min)
    python bench/longrun.py --only onebit --steps 500   # measure one first
    python bench/longrun.py --plot                # redraw the figure from the JSONs

Writes ``bench/results/longrun/<setting>.json`` (every rank's samples) and
``bench/results/longrun/longrun.png`` (rank 0). Evidence (2 CPU cores, gloo):
threads and open files constant from step 250 to 20,000 in every setting and on every rank;
RSS +0.15 to +0.36 MiB from step 1,000 to 20,000 (plain DDP: +0.02). bench/RESULTS.md,
"Long runs".
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the ranks unpickle rank_main as longrun.rank_main
    sys.path.insert(0, HERE)

OUT = os.path.join(HERE, "results", "longrun")

# name -> (spec, world, per_node, register kwargs). warmup=none where the issue asks for it;
# terngrad keeps its adaptive warm-up (the dense -> compressed switch is one more path to run
# for 20,000 steps; the JSON records the step it switched at); powersgd with local_steps > 1
# runs warmup=none by default (README, "Warm-up").
SETTINGS = {
    "onebit": ("onebit", 2, 1, {"warmup": "none"}),
    "topk_delay1": ("topk:delay=1", 2, 1, {"warmup": "none"}),
    "terngrad_lanes4": ("terngrad", 2, 1, {"lanes": 4}),
    "powersgd_local4": ("powersgd:local_steps=4", 2, 1, {}),
    "onebit_hier_2x2": ("onebit:topology=hierarchical,local_size=2", 4, 2, {"warmup": "none"}),
    # the control: the same job with DDP's own allreduce and nothing registered, what torch
    # and gloo alone do to RSS, threads and files over 20,000 steps
    "ddp_control": (None, 2, 1, {}),
}


def usage() -> dict:
    """This process's RSS (MiB), Python and OS threads, and open file descriptors."""
    gc.collect()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/status") as f:
        os_threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return {"rss_mib": rss / 2**20, "py_threads": threading.active_count(),
            "os_threads": os_threads, "fds": len(os.listdir("/proc/self/fd"))}


def rank_main(rank, world, spec, kwargs, steps, every):
    """One rank of one setting: train ``steps`` optimizer steps, sampling every ``every``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcomp

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 48), nn.Tanh(),
                        nn.Linear(48, 10))
    model = DDP(net, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = spec and gradcomp.register(model, spec, optimizer=opt, min_numel=0, **kwargs)
    g = torch.Generator().manual_seed(1000 + rank)
    data = [(torch.randn(16, 20, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(16)]

    samples = []
    start = time.perf_counter()

    def sample(step, loss):
        samples.append({"step": step, "wall_s": time.perf_counter() - start,
                        "loss": None if loss is None else float(loss), **usage()})

    sample(0, None)
    for step in range(1, steps + 1):
        x, y = data[step % len(data)]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if step % every == 0:
            sample(step, loss.item())
    if state and state.config.delay:
        state.flush()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    stats = state.stats() if state else {}
    # no rank closes while another still samples: a peer's close() destroys the groups it
    # shares with this rank, and their sockets leave this rank's /proc/self/fd (seen: 84 -> 80
    # in the last sample of a 4-rank run before this barrier)
    dist.barrier()
    if state:
        state.close()
    dist.barrier()
    # close() has stopped the lanes (Python threads back to 1); the gloo threads and sockets
    # of the groups it destroyed go when the state object is freed, which this frame does not
    # do: this sample is "closed, still referenced"
    closed = usage()
    return {"rank": rank, "samples": samples, "after_close": closed,
            "wall_s": time.perf_counter() - start,
            "params_finite": bool(torch.isfinite(params).all()),
            "params_sum": float(params.double().sum()),
            "stats": {k: stats[k] for k in ("step", "compressing", "warmup_switch_step",
                                            "ratio", "collectives") if k in stats}}


def run_setting(name, steps, every, timeout):
    import torch

    from gradcomp_bench.launch import RankError, spawn

    import longrun  # by name, so that the spawned ranks can unpickle it

    spec, world, per_node, kwargs = SETTINGS[name]
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                         capture_output=True, text=True).stdout.strip()
    row = {"setting": name, "spec": spec or "plain DDP, nothing registered",
           "register_kwargs": dict(kwargs, min_numel=0) if spec else None,
           "world": world, "per_node": per_node, "steps": steps, "every": every,
           "torch": torch.__version__, "git_sha": sha,
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": " ".join(["python", "bench/longrun.py"] + sys.argv[1:])}
    t0 = time.perf_counter()
    try:
        row["ranks"] = spawn(longrun.rank_main, world, args=(spec, kwargs, steps, every),
                             timeout=timeout, per_node=per_node)
    except RankError as exc:
        row["error"] = str(exc)[-4000:]
    row["total_s"] = time.perf_counter() - t0
    return row


def summary(row) -> dict:
    """The RESULTS table's numbers: rank 0's, and the worst of every rank (``*_any``). The
    base is the sample at step 1,000 (half the run for a shorter trial), after start-up."""
    out = {}
    for r in row["ranks"]:
        s = r["samples"]
        after = [x for x in s if x["step"] >= min(1000, s[-1]["step"] // 2)]
        m = {"rss_base": after[0]["rss_mib"], "rss_end": s[-1]["rss_mib"],
             "rss_growth": s[-1]["rss_mib"] - after[0]["rss_mib"],
             **{f"{k}_spread": max(x[k] for x in after) - min(x[k] for x in after)
                for k in ("os_threads", "py_threads", "fds")},
             **{k: s[-1][k] for k in ("os_threads", "py_threads", "fds", "wall_s")},
             "ms_per_step": 1000 * s[-1]["wall_s"] / s[-1]["step"]}
        if r["rank"] == 0:
            out.update(m)
        for k in ("rss_growth", "os_threads_spread", "py_threads_spread", "fds_spread"):
            out[f"{k}_any"] = max(out.get(f"{k}_any", m[k]), m[k])
    return out


def _label_levels(ax, series, steps, close):
    """Name the settings that share each final level of ``series`` ([(name, values)]), next to
    the line: on an integer count several settings often lie on one line. Neighbouring levels'
    labels go at different steps, so that they do not overlap."""
    levels = {}
    for name, values in series:
        levels.setdefault(values[-1], []).append(name)
    keys = sorted(levels)
    for j, v in enumerate(keys):
        below = j + 1 < len(keys) and close(v, keys[j + 1])  # the next level is near
        x = steps * (0.3 + 0.25 * (j % 3))
        ax.annotate(", ".join(levels[v]) + f": {v:g}", (x, v), xytext=(0, -4 if below else 4),
                    textcoords="offset points", ha="center", va="top" if below else "bottom",
                    fontsize=7.5, color="0.25")


def plot(names, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for name in names:
        path = os.path.join(out, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                row = json.load(f)
            if "ranks" in row:
                rows.append(row)
    if not rows:
        return
    keys = ("rss_mib", "os_threads", "py_threads", "fds")
    fig, axes = plt.subplots(3, 1, figsize=(9, 11), sharex=True,
                             gridspec_kw={"height_ratios": [1, 1.3, 1]})
    series = {k: [] for k in keys}
    for i, row in enumerate(rows):
        s = row["ranks"][0]["samples"]
        steps = [x["step"] for x in s]
        # settings often lie on one integer (threads, fds): markers at staggered samples keep
        # every setting visible where the lines coincide
        kw = dict(color=f"C{i}", lw=1.4, marker="osD^v"[i % 5], ms=5,
                  markevery=(1 + 2 * i, 2 * len(rows)))
        for k in keys:
            series[k].append((row["setting"], [x[k] for x in s]))
        axes[0].plot(steps, series["rss_mib"][-1][1], **kw,
                     label=f"{row['setting']}: {row['spec']}, {row['world']} ranks")
        axes[1].plot(steps, series["os_threads"][-1][1], **kw)
        axes[1].plot(steps, series["py_threads"][-1][1], ls="--", **kw)
        axes[2].plot(steps, series["fds"][-1][1], **kw)
    # threads on a log scale: 1-5 Python threads and 6-44 OS threads stay apart
    axes[1].set_yscale("log")
    axes[1].set_yticks([1, 2, 3, 5, 10, 20, 30, 50], ["1", "2", "3", "5", "10", "20", "30", "50"])
    axes[1].minorticks_off()
    _label_levels(axes[1], series["os_threads"] + series["py_threads"], rows[0]["steps"],
                  lambda a, b: b / a < 1.3)
    _label_levels(axes[2], series["fds"], rows[0]["steps"], lambda a, b: b - a < 5)
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].set_ylabel("threads, log scale\n(solid: OS, dashed: Python)")
    axes[2].set_ylabel("open file descriptors")
    axes[2].set_xlabel("optimizer step")
    for ax in axes:
        ax.axvspan(0, 1000, color="0.92", zorder=0)
        ax.grid(alpha=0.3)
        ax.margins(y=0.12)
    axes[0].text(1100, 0.5, "grey: start-up, before\nthe table's base (step 1,000)",
                 transform=axes[0].get_xaxis_transform(), fontsize=8, color="0.4")
    axes[0].legend(fontsize=8, loc="lower right")
    axes[0].set_title(f"gradcomp long runs, rank 0, sampled every {rows[0]['every']} steps")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "longrun.png"), dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--only", default=",".join(SETTINGS),
                   help=f"comma-separated settings of: {', '.join(SETTINGS)}")
    p.add_argument("--out", default=OUT)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per setting")
    p.add_argument("--plot", action="store_true", help="only redraw the figure")
    a = p.parse_args()
    names = [n for n in a.only.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; allowed: {', '.join(SETTINGS)}")
    os.makedirs(a.out, exist_ok=True)
    if not a.plot:
        for name in names:
            row = run_setting(name, a.steps, a.every, a.timeout)
            with open(os.path.join(a.out, f"{name}.json"), "w") as f:
                json.dump(row, f, indent=1)
            if "error" in row:
                print(f"{name}: FAILED after {row['total_s']:.0f}s\n{row['error']}", flush=True)
                continue
            m = summary(row)
            print(f"{name}: {m['ms_per_step']:.2f} ms/step, {m['wall_s']:.0f}s; "
                  f"RSS {m['rss_base']:.1f} -> {m['rss_end']:.1f} MiB ({m['rss_growth']:+.2f}, "
                  f"any rank {m['rss_growth_any']:+.2f}); "
                  f"OS threads {m['os_threads']} (spread {m['os_threads_spread']}), "
                  f"Python threads {m['py_threads']} (spread {m['py_threads_spread']}), "
                  f"fds {m['fds']} (spread {m['fds_spread']}); any rank's spreads "
                  f"{m['os_threads_spread_any']}/{m['py_threads_spread_any']}/"
                  f"{m['fds_spread_any']}", flush=True)
    plot(list(SETTINGS), a.out)


if __name__ == "__main__":
    main()
