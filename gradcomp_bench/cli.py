"""``gradcomp-bench``: how much each method saves on your job and your link.

    gradcomp-bench ddp                      # default: short run, 2 local ranks, loopback
    gradcomp-bench ddp --model resnet18 --link 100mbit,1gbit --latency 50ms
    gradcomp-bench convergence --epochs 30 --data ~/cifar-10-batches-py
    gradcomp-bench kernels
    gradcomp-bench plan --gpus 8,64,1024 --links 1gbit,100gbit   # the cost model's projection
    gradcomp-bench plan --check             # the cost model against the rig's measurements
    torchrun --nnodes 2 --nproc-per-node 1 ... -m gradcomp_bench.cli ddp   # your real network

Under torchrun each process is one rank (NCCL on GPUs, gloo on CPUs) and rank 0 prints.

Bad input (unknown method, unreadable data, a rate that does not parse, a world size that
does not fit) prints one line naming the problem and exits with code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import textwrap
from pathlib import Path

from . import model_names

DEFAULT_METHODS = ("ddp,noop,allreduce,fp16,torch-powersgd:rank=2,dgc:ratio=0.001,onebit,"
                   "terngrad,powersgd:rank=2,topk:ratio=0.01")
# every method at its defaults (the adaptive warm-up included), torch's PowerSGD hook beside,
# each bucket's exchange completed in the hook (on gloo it otherwise aborts: train._in_order)
CONVERGENCE_METHODS = ("allreduce,dgc,onebit,terngrad,powersgd,topk,threshold,"
                       "torch-powersgd:rank=2,ordered=1")


class UsageError(Exception):
    pass


def _lanes(args) -> None:
    if getattr(args, "lanes", 1) < 1:
        raise UsageError(f"--lanes {args.lanes}: expected an integer >= 1")


def _check_device(args) -> None:
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available here")


def _methods(text: str) -> list[str]:
    from .train import parse_method
    specs = _split_specs(text)
    for s in specs:
        try:
            parse_method(s)
        except ValueError as exc:
            raise UsageError(f"--methods: {exc}") from None
    return specs


def _split_specs(text: str) -> list[str]:
    """Split "a:x=1,y=2,b,c:z=3" into specs: a comma starts a new spec unless key=value."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" in part and ":" not in part and out:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def _worlds(text: str) -> list[int]:
    try:
        ws = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise UsageError(f"--world {text!r}: expected integers like 2 or 2,4") from None
    limit = 4 * (os.cpu_count() or 1)
    for w in ws:
        if not 1 <= w <= limit:
            raise UsageError(f"--world {w} does not fit: this machine runs 1..{limit} local ranks "
                             f"({os.cpu_count()} cores); use torchrun for more")
    return ws


def _data(args):
    from . import data
    if args.synthetic:
        return None
    try:
        found = data.resolve(args.data)
    except ValueError as exc:
        raise UsageError(f"--data: {exc}") from None
    if found is None:
        print("gradcomp-bench: warning: no CIFAR-10 data found (searched "
              + ", ".join(str(p) for p in data.default_dirs())
              + "); using SYNTHETIC data: step times are real, accuracies are not",
              file=sys.stderr)
        args.synthetic = True
        return None
    return str(found)


def _progress(jobs, label, disable=False):
    """tqdm over ``jobs`` on stderr; ``label(job)`` names the job that is running."""
    from tqdm import tqdm
    bar = tqdm(jobs, file=sys.stderr, unit="run", dynamic_ncols=True, disable=disable)
    for job in bar:
        bar.set_postfix_str(label(job)[:60])
        yield job


def _write_json(args, out_dir: Path, cmd: str, doc: dict) -> Path:
    """The run's rows, written before anything is drawn from them: ``--json`` or
    OUT/<cmd>.json."""
    path = Path(args.json) if args.json else out_dir / f"{cmd}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kind": cmd, "argv": sys.argv, **doc}, indent=1, default=str))
    print(f"json: {path}")
    return path


def _plot(doc_path: Path, out_dir: Path) -> None:
    from . import plots
    paths = plots.plot(json.loads(doc_path.read_text()), out_dir)
    print("plots: " + ", ".join(str(p) for p in paths))


# --------------------------------------------------------------------------- ddp
def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"))


def _torchrun_ranks(cfg):
    """This process is one rank of a torchrun job: train here; every rank returns its result."""
    import datetime
    import torch
    import torch.distributed as dist
    from .train import train
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    return [train(dist.get_rank(), dist.get_world_size(), cfg)]


def _context(model: str) -> int:
    """A language model's context (positions), read from a copy built on the meta device."""
    import torch
    from .models import build
    with torch.device("meta"):
        return build(model).context


def cmd_ddp(args) -> int:
    from . import bench, report
    from .launch import RankError
    from .train import TrainConfig
    methods = _methods(args.methods)
    _lanes(args)
    _check_device(args)
    torchrun = _under_torchrun()
    if torchrun and args.link not in (None, "auto", "none"):
        raise UsageError("--link shapes local ranks; under torchrun your real network is the link")
    per_node = args.ranks_per_node
    if per_node < 1:
        raise UsageError(f"--ranks-per-node {per_node}: allowed an integer >= 1")
    if args.nodes is not None:
        if args.nodes < 1:
            raise UsageError(f"--nodes {args.nodes}: allowed an integer >= 1")
        args.world = str(args.nodes * per_node)
    worlds = [int(os.environ["WORLD_SIZE"])] if torchrun else _worlds(args.world)
    bad = [w for w in worlds if w % per_node]
    if bad and not torchrun:
        raise UsageError(f"--world {bad[0]} is not a whole number of nodes of "
                         f"--ranks-per-node {per_node}")
    rates = [None]
    link_note = None
    if args.link == "auto":  # a real slow link where this machine can make one
        args.link, link_note = (None, None) if torchrun or args.latency else _auto_link()
    elif args.link == "none":
        args.link = None
    if args.link:
        from . import netlink
        try:
            rates = [netlink.parse_rate(r) for r in args.link.split(",")]
            latency = netlink.parse_time(args.latency) if args.latency else 0.0
            netlink.check_available()
        except (ValueError, netlink.LinkUnavailable) as exc:
            raise UsageError(str(exc)) from None
    elif args.latency:
        raise UsageError("--latency needs --link (the delay is added on the shaped link)")
    data_dir = _data(args)
    from .models import LANGUAGE_MODELS, MODELS
    if args.model not in MODELS:
        raise UsageError(f"--model {args.model!r}: allowed {', '.join(MODELS)}")
    if args.model in LANGUAGE_MODELS and args.data is None:
        data_dir = None  # the text corpus is found by data.load_text
    if args.parallel != "ddp" and args.model not in LANGUAGE_MODELS:
        raise UsageError(f"--parallel {args.parallel}: for language models (--model gpt)")
    if args.parallel == "hsdp" and (per_node < 2 or any(w // per_node < 2 for w in worlds)):
        raise UsageError(f"--parallel hsdp: needs --ranks-per-node >= 2 (the shard group) and "
                         f"at least 2 nodes (--nodes, or --world)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}: allowed an integer >= 1")
    # round k runs the method list rotated by k: the machine's drift within a run falls on
    # every method alike, and each method's ratio pairs it with its own round's noop
    jobs = [(w, r, m, k) for k in range(args.rounds) for w in worlds for r in rates
            for m in methods[k % len(methods):] + methods[:k % len(methods)]]
    if args.rounds == 1 and "noop" in methods:
        # compute-only once more after the others: how far the machine's speed moved during
        # the run, which a ratio to compute-only must exceed to say anything (report.mark_noise)
        jobs += [(w, r, "noop", AFTER) for w in worlds for r in rates]
    if link_note:
        print(link_note, file=sys.stderr)
    rows, raw, failed, after = [], [], [], {}
    load_before = _load()
    scalars = report.Scalars(args.tensorboard)
    quiet = torchrun and int(os.environ["RANK"]) != 0
    for w, rate, m, k in _progress(
            jobs, lambda j: f"world {j[0]} link {_rate_name(j[1])} {j[2]}"
            + (" again" if j[3] == AFTER else f" round {j[3] + 1}" if args.rounds > 1 else ""),
            disable=quiet):
        cfg = TrainConfig(method=m, model=args.model, data=data_dir, synthetic=args.synthetic,
                          epochs=0, max_steps=args.steps + args.warmup, batch=args.batch,
                          eval=False, seed=args.seed,
                          options={**_delay_opts(m, args), **_steady(m, args.model)},
                          device=args.device, broadcast_buffers=args.broadcast_buffers,
                          barrier=args.barrier, parallel=args.parallel,
                          ranks_per_node=per_node if args.parallel == "hsdp" else 0)
        try:
            if torchrun:
                ranks = _torchrun_ranks(cfg)
            elif rate is None:
                ranks = bench.run_train(w, cfg, per_node=per_node)
            else:
                from .netlink import Link
                with Link(rate, latency, n=w // per_node) as link:
                    ranks = bench.run_train(w, cfg, link=link, per_node=per_node)
            res = ranks[0]
        except RankError as exc:
            # one method's failure (torch's PowerSGD hook on gloo can abort on a collective
            # mismatch, bench/torch_powersgd_gloo.py) must not lose the runs around it: it
            # is recorded, the others go on, and the command exits 1 at the end (under
            # torchrun this process is a rank itself: no RankError reaches here)
            failed.append({"method": m, "world": w, "link_bps": rate, "round": max(k, 0),
                           **({"after": True} if k == AFTER else {}),
                           "error": _last_error_line(exc)})
            print(f"gradcomp-bench ddp: {m} (world {w}, {_rate_name(rate)}"
                  + (f", round {k + 1}" if args.rounds > 1 else "") + ") failed: "
                  + failed[-1]["error"], file=sys.stderr)
            continue
        row = bench.summarize(m, res, w, rate, args.warmup, args.model)
        row["cpu_share"] = bench.cpu_share(ranks, args.warmup)
        if k == AFTER:
            after[(w, rate)] = (row["step_s"], row["cpu_share"])
            raw.append({"method": m, "world": w, "link_bps": rate, "round": 0, "after": True,
                        "step_times": res["step_times"]})
            continue
        row["round"] = k
        rows.append(row)
        raw.append({"method": m, "world": w, "link_bps": rate, "round": k,
                    "step_times": res["step_times"],
                    "phases": res.get("phases"),
                    **({"method_probe": (res.get("stats") or {}).get("method_probe")}
                       if m.startswith("auto") else {})})
        tag = f"w{w}/{_rate_name(rate)}/{m}"
        for s, t in enumerate(res["step_times"]):
            scalars.add(f"{tag}/step_time_s", t, s)
        for s, h in enumerate(res.get("stats_history") or []):
            scalars.add(f"{tag}/wire_bytes", h["wire_bytes"], s)
            scalars.add(f"{tag}/compression_ratio", h["ratio"], s)
    scalars.close()
    if quiet:
        return 0
    rows = bench.combine_rounds(rows, methods)
    noop = {(r["world"], r["link_bps"]): r["step_s"] for r in rows if r["method"] == "noop"}
    for r in rows:
        if r["method"] == "noop" and (r["world"], r["link_bps"]) in after:
            r["step_after_s"], r["cpu_share_after"] = after[(r["world"], r["link_bps"])]
        for bw in (1e8, 1e9, 1e10):  # the step projected to other links (bench.project)
            r[f"at_{_rate_name(bw)}_s"] = bench.project(r, bw, noop.get((r["world"],
                                                                           r["link_bps"])))
    report.mark_noise(rows)
    machine = report.machine_check(rows, cores_per_rank=_cores_per_rank(worlds, torchrun),
                                   load=(load_before, _load()))
    setup = _setup(args, worlds, rates, latency if args.link else 0.0, torchrun, per_node)
    doc = _write_json(args, out_dir, "ddp", {"setup": setup, "machine": machine, "rows": rows,
                                             "raw": raw,
                                             **({"failed": failed} if failed else {})})
    print(ddp_table(rows, setup, machine))
    if rows:
        _plot(doc, out_dir)
    if failed:
        print(f"{len(failed)} of {len(jobs)} runs failed (in the JSON's \"failed\"): "
              + ", ".join(f"{f['method']}" + (f" round {f['round'] + 1}" if args.rounds > 1
                                              else "") for f in failed), file=sys.stderr)
        return 1
    return 0


AFTER = -1  # the round of compute-only's closing run (``ddp`` with one round)


def _load() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _cores_per_rank(worlds, torchrun) -> dict:
    """Per world size, the share of a core each rank on this machine can have when nothing
    else runs (local ranks all run here; under torchrun LOCAL_WORLD_SIZE of them)."""
    cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return {w: min(1.0, cores / (local if torchrun else w)) for w in worlds}


def _setup(args, worlds, rates, latency, torchrun, per_node) -> dict:
    """What the run measured, for the header and the JSON: the model (its parameters and
    fp32 gradient), the ranks, the link, the batch and the steps."""
    import torch
    from .models import build
    with torch.device("meta"):
        params = sum(p.numel() for p in build(args.model).parameters())
    if torchrun:
        link = "your network (torchrun)"
    elif rates == [None]:
        link = "loopback (no shaped link: messages cross memory)"
    else:
        link = (", ".join(f"a real {_rate_name(r)} link" for r in rates)
                + " (network namespaces, tc tbf)")
        if latency:
            link += f", {latency * 1e3:g} ms one way"
    return {"model": args.model, "parameters": params, "grad_MB": 4 * params / 1e6,
            "worlds": worlds, "ranks_per_node": per_node, "link": link,
            "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
            "rounds": args.rounds, "device": args.device, "cores": os.cpu_count()}


def _delay_opts(method, args):
    """Options for register(): --delay and --lanes (DDP only: FSDP refuses it), for gradcomp
    methods only."""
    if not _is_gradcomp(method):
        return {}
    lanes = {"lanes": args.lanes} if getattr(args, "parallel", "ddp") == "ddp" else {}
    return {**lanes, **({"delay": args.delay} if args.delay else {})}


def _steady(method, model=None) -> dict:
    """A step-time run measures the compressed exchange: the adaptive warm-up (dense for at
    least its first two windows) is off unless the spec sets a warm-up itself. A language
    model (AdamW) runs with ``adam="off"`` too: Adam's variance frozen after too few dense
    steps to estimate it makes the run diverge within steps (and its inf/NaN fallback would
    then be what is timed); the plain AdamW step costs the same."""
    if not _is_gradcomp(method) or "warmup=" in method or "dense_steps=" in method:
        return {}
    from .models import LANGUAGE_MODELS
    if model in LANGUAGE_MODELS and method.split(":")[0] != "allreduce" and "adam=" not in method:
        return {"warmup": "none", "adam": "off"}
    return {"warmup": "none"}


def _is_gradcomp(method) -> bool:
    from .train import is_gradcomp
    return is_gradcomp(method)


def _hook_log(method, args):
    """With --tensorboard, a gradcomp method also writes the hook's own per-step scalars
    (memory norms, DGC's sparsity, PowerSGD's approximation error) under DIR/hook/<method>."""
    if not args.tensorboard or not _is_gradcomp(method):
        return {}
    return {"log_dir": str(Path(args.tensorboard) / "hook" / re.sub(r"[^\w.=-]+", "_", method)),
            "log_details": True}


def _auto_link():
    """``--link auto``: (a shaped 100 Mbit/s link where the machine allows one (root,
    iproute2), else None for loopback; the line that says which, printed once the run
    starts)."""
    from . import netlink
    try:
        netlink.check_available()
    except netlink.LinkUnavailable as exc:
        return None, (f"link: loopback (no shaped link here: {exc}). Every message crosses "
                      f"memory, so compression only adds its codec's cost; it pays on links "
                      f"slower than ~10 Gbit/s: run as root with --link 100mbit to see it.")
    return "100mbit", ("link: a real 100 Mbit/s link between the ranks (network namespaces + "
                       "tc tbf); read the 'x compute' column and the figure ddp_step_time.png")


def _rate_name(rate):
    return "loopback" if rate is None else f"{rate / 1e6:g}mbit"


NOISE_MARK = "*"


# one line per column of the ddp table: what its figure is
DDP_LEGEND = {
    "method": "noop: compute only, no communication; ddp: DDP without a hook; fp16, "
              "torch-powersgd: torch's own hooks; the rest: gradcomp's",
    "W": "ranks",
    "link": "the link between the ranks (loopback: none)",
    "step ms": "median step time over the measured steps",
    "p20-p80": "the 20th-80th percentile of the step times (ms)",
    "x compute": "step / the compute-only step (noop, no communication) of the same run: "
                 "1.00 = the exchange is free",
    "x rounds": "the range of x compute over the --rounds",
    "x paced": "x compute counted in forwards ((step / forward) / noop's): the machine's "
               "drift cancels",
    "wire MB": "MB each rank puts on the wire per step (gradcomp: measured; DDP and torch's "
               "hooks: computed)",
    "ratio": "fp32 allreduce's bytes on the wire per rank / this method's: x fewer bytes "
             "(- : sends nothing)",
}


def ddp_header(setup: dict) -> str:
    """The line that says what a ``ddp`` run measured: the model, the ranks and the link."""
    from .models import describe
    worlds = ", ".join(map(str, setup["worlds"]))
    return (f"{setup['model']} ({describe(setup['model'])}, {setup['parameters'] / 1e6:.2f}M "
            f"parameters, {setup['grad_MB']:.1f} MB of fp32 gradient), {worlds} ranks, "
            f"{setup['link']}; batch {setup['batch']} per rank, {setup['steps']} steps timed "
            f"after {setup['warmup']}")


def ddp_table(rows, setup: dict | None = None, machine: dict | None = None) -> str:
    """The key columns, one row per method, within 100 characters for the default methods
    (the rest of each row is in the JSON: the mean, the bound and the floor, the codec's
    time, the step's split, the step projected to 100 Mbit/s, 1 and 10 Gbit/s
    (``at_100mbit_s``, ``at_1000mbit_s``, ``at_10000mbit_s``), where it beats DDP); above it
    what was measured (``setup``: :func:`ddp_header`) and, where ``machine`` says so
    (``report.machine_check``), that the machine was too busy to measure; a world and link
    shared by every row go in a line above it; below it one line per column; a ratio to
    compute-only that says nothing is marked and footnoted (``report.mark_noise``)."""
    from . import report
    view = []
    for r in rows:
        v = dict(r)
        v["link"] = _rate_name(r["link_bps"])
        v["step_ms"] = r["step_s"] * 1e3
        v["spread"] = f"{r['p20_s'] * 1e3:.0f}-{r['p80_s'] * 1e3:.0f}"
        x = r.get("x_compute")
        v["x_compute"] = None if x is None else (
            f"{x:.2f}" + (NOISE_MARK if r.get("within_noise") else " "))
        xp = r.get("x_paced")  # drift cancels in it, but below 1 it is noise as well
        v["x_paced"] = None if xp is None else f"{xp:.2f}" + (NOISE_MARK if xp < 1.0 else " ")
        v["x_range"] = (f"{r['x_compute_lo']:.2f}-{r['x_compute_hi']:.2f}"
                        if "x_compute_lo" in r else None)
        v["wire_MB"] = r["wire_bytes"] / 1e6
        view.append(v)
    cols = [("method", "method", ""), ("world", "W", "d"), ("link", "link", ""),
            ("step_ms", "step ms", ".0f"), ("spread", "p20-p80", ""),
            ("x_compute", "x compute", ""), ("x_range", "x rounds", ""),
            ("x_paced", "x paced", ""), ("wire_MB", "wire MB", ".3f"),
            ("ratio", "ratio", ".1f")]
    out = []
    if setup:
        out.append(textwrap.fill(ddp_header(setup), width=100))
    warning = report.busy_warning(machine)
    if warning:
        out.append(warning)
    if len({(v["world"], v["link"]) for v in view}) == 1:
        out.append(f"world {view[0]['world']}, link {view[0]['link']}")
        cols = [c for c in cols if c[0] not in ("world", "link")]
    cols = report.visible(view, cols)
    out.append(report.table(view, cols))
    note = report.noise_note(rows, NOISE_MARK, any((r.get("x_paced") or 1.0) < 1.0 for r in rows))
    if note:
        out.append(note)
    out += [textwrap.fill(f"{h}: {DDP_LEGEND[h]}", width=100, subsequent_indent="  ")
            for _, h, _ in cols if h in DDP_LEGEND]
    if warning:
        out.append("WARNING: too busy to measure (above; the JSON's \"machine\" says why).")
    return "\n".join(out)


# --------------------------------------------------------------------------- convergence
def cmd_convergence(args) -> int:
    from . import bench, report
    from .launch import RankError
    from .train import TrainConfig
    methods = _methods(args.methods)
    _lanes(args)
    _check_device(args)
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g}: expected seconds > 0 (or leave it out: no limit)")
    worlds = _worlds(str(args.world))
    data_dir = _data(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from .models import LANGUAGE_MODELS, MODELS
    if args.model not in MODELS:
        raise UsageError(f"--model {args.model!r}: allowed {', '.join(MODELS)}")
    lm = args.model in LANGUAGE_MODELS
    if lm and args.steps < 1:
        raise UsageError(f"--steps {args.steps}: expected an integer >= 1")
    if lm:
        context = _context(args.model)
        if args.seq_len is None:
            args.seq_len = min(64, context)
        elif not 1 <= args.seq_len <= context:
            raise UsageError(f"--seq-len {args.seq_len}: allowed 1 to {context}, the context of "
                             f"--model {args.model}")
    if lm and args.data is None:
        data_dir = None  # the text corpus is found by data.load_text
    from .peers import is_peer, missing
    if any(is_peer(m) for m in methods) and (not lm or args.parallel != "ddp"):
        raise UsageError(f"--methods {','.join(m for m in methods if is_peer(m))}: peers run on "
                         f"language models (--model {'/'.join(LANGUAGE_MODELS)}) with --parallel ddp")
    why = next(filter(None, (missing(m) for m in methods if is_peer(m))), None)
    if why:
        raise UsageError(f"--methods: {why}")
    if args.parallel != "ddp" and not lm:
        raise UsageError(f"--parallel {args.parallel}: for language models (--model gpt); CNNs "
                         f"train under DDP")
    if args.parallel == "hsdp":
        w = worlds[0]
        args.ranks_per_node = args.ranks_per_node or w // 2
        if not (1 < args.ranks_per_node < w and w % args.ranks_per_node == 0):
            raise UsageError(f"--parallel hsdp --world {w} --ranks-per-node "
                             f"{args.ranks_per_node}: needs a world of at least 4 and a "
                             f"ranks-per-node dividing it, between 2 and world/2")
    scalars = report.Scalars(args.tensorboard)
    results, failed = {}, {}
    for m in _progress(methods, str):
        common = dict(method=m, model=args.model, data=data_dir, synthetic=args.synthetic,
                      seed=args.seed, eval=True, device=args.device,
                      options={**_delay_opts(m, args), **_hook_log(m, args)})
        if lm:  # AdamW on the character corpus (train.train_lm)
            cfg = TrainConfig(**common, max_steps=args.steps, batch=args.batch or 16,
                              lr=args.lr or 1e-3, weight_decay=0.1, seq_len=args.seq_len,
                              optimizer=args.optimizer, bf16=args.bf16, parallel=args.parallel,
                              clip_steps=args.clip_steps,
                              ranks_per_node=args.ranks_per_node)
        else:
            cfg = TrainConfig(**common, epochs=args.epochs, batch=args.batch or 64,
                              lr=args.lr or 0.05, schedule=args.schedule,
                              optimizer=args.optimizer)
        try:
            res = bench.run_train(worlds[0], cfg, timeout=args.timeout)[0]
        except RankError as exc:
            # one method's failure (torch's own PowerSGD hook on gloo has failed this way: a
            # size mismatch between ranks) costs its row, not the other methods' runs
            failed[m] = _last_error_line(exc)
            print(f"gradcomp-bench: {m} failed: {failed[m]}", file=sys.stderr)
        else:
            results[m] = res
            for c in res["curve"]:
                for key in ("test_acc", "test_loss", "val_loss", "train_loss"):
                    if key in c:
                        scalars.add(f"{m}/{key}", c[key], c["step"])
            for s, h in enumerate(res.get("stats_history") or []):
                scalars.add(f"{m}/compression_ratio", h["ratio"], s)
                scalars.add(f"{m}/wire_bytes", h["wire_bytes"], s)
        # written after every method: a run cut short keeps what it finished
        doc = _write_json(args, out_dir, "convergence", _convergence_doc(args, results, failed))
    scalars.close()
    rows = json.loads(doc.read_text())["rows"]
    if lm:
        cols = [("method", "method", ""), ("val_loss", "val loss", ".4f"),
                ("d_loss_pct", "vs allreduce %", "+.2f"), ("wire_MB", "wire MB/run", ".1f"),
                ("run_ratio", "x fewer bytes", ".1f"), ("switch", "first compressed step", ""),
                ("step_ms", "step ms", ".0f"), ("failed", "failed", "")]
    else:
        cols = [("method", "method", ""), ("test_acc", "test acc %", ".2f"),
                ("d_acc", "vs allreduce", "+.2f"), ("test_loss", "test loss", ".3f"),
                ("ratio", "compression", ".0f"), ("wire_MB", "wire MB/run", ".1f"),
                ("step_ms", "step ms", ".0f"), ("failed", "failed", "")]
    print(report.table(rows, cols))
    if results:
        _plot(doc, out_dir)
    return 1 if failed else 0


def _last_error_line(exc: Exception) -> str:
    """The most specific line of a rank failure: the last that names an error."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    named = ([ln for ln in lines if "Error" in ln] or [ln for ln in lines if "error" in ln]
             or lines or [type(exc).__name__])
    return named[-1][:300]


def _run_wire_MB(history) -> float | None:
    """The run's wire bytes (MB): each state step's record once (:func:`bench.step_records`;
    with ``local_steps`` a step is a round). None for torch's hooks (no stats)."""
    if not history:
        return None
    from .bench import step_records
    return sum(r["wire_bytes"] for r in step_records(history)) / 1e6


def _run_MB(method: str, res: dict, model: str) -> float | None:
    """The run's wire MB: measured for gradcomp methods; for torch's PowerSGD hook computed
    from the model (its first ``start`` steps dense, then rank-r factors every step)."""
    measured = _run_wire_MB(res.get("stats_history"))
    if measured is not None or not method.startswith("torch-powersgd"):
        return measured
    from .bench import model_bytes
    from .train import parse_method
    opts = parse_method(method)[1]
    raw, ps = model_bytes(model, rank=opts["rank"])
    steps = len(res["step_times"])
    return (raw * min(opts["start"], steps) + ps * max(0, steps - opts["start"])) / 1e6


def _convergence_doc(args, results: dict, failed: dict) -> dict:
    base = results.get("allreduce") or results.get("ddp") or next(iter(results.values()), None)
    rows = []
    for m, r in results.items():
        row = {"method": m, "wire_MB": _run_MB(m, r, args.model),
               "ratio": (r.get("stats") or {}).get("ratio"),
               "switch": (r.get("stats") or {}).get("warmup_switch_step"),
               "step_ms": 1e3 * statistics.median(r["step_times"])}
        if "val_loss" in r:  # a language model: validation loss, lower is better
            row.update(val_loss=r["val_loss"], d_loss=r["val_loss"] - base["val_loss"],
                       d_loss_pct=100 * (r["val_loss"] / base["val_loss"] - 1))
        else:
            row.update(test_acc=100 * r["test_acc"], test_loss=r["test_loss"],
                       d_acc=100 * (r["test_acc"] - base["test_acc"]))
        rows.append(row)
    base_MB = next((row["wire_MB"] for row in rows if row["method"] == "allreduce"), None)
    for row in rows:
        if base_MB and row["wire_MB"]:
            row["run_ratio"] = base_MB / row["wire_MB"]
    rows += [{"method": m, "failed": why} for m, why in failed.items()]
    return {"seed": args.seed, "rows": rows, "curves": {m: r["curve"] for m, r in results.items()}}


# --------------------------------------------------------------------------- overlap
def cmd_overlap(args) -> int:
    """Time one backward per method: do the exchanges run while gradients are computed?"""
    from . import bench, report
    from .launch import spawn
    methods = _methods(args.methods)
    _lanes(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [spawn(bench.profile_overlap, 2, args=(m, args.model, args.batch))[0]
            for m in _progress(methods, str)]
    doc = _write_json(args, out_dir, "overlap", {"rows": rows})
    view = [{"method": r["method"], "compute_ms": r["backward_ops_end"],
             "backward_ms": r["backward"][1] - r["backward"][0],
             "exchanges": len(r["exchanges"]), "exchange_ms": 1e3 * r["exchange_s"],
             "overlap": r["overlapped_s"] / r["exchange_s"] if r["exchange_s"] else None}
            for r in rows]
    print(report.table(view, [("method", "method", ""), ("compute_ms", "grads computed ms", ".1f"),
                              ("backward_ms", "backward returns ms", ".1f"),
                              ("exchanges", "bucket exchanges", "d"),
                              ("exchange_ms", "exchange ms", ".1f"),
                              ("overlap", "share during backward", ".0%")]))
    _plot(doc, out_dir)
    return 0


# --------------------------------------------------------------------------- kernels
def cmd_kernels(args) -> int:
    if args.ops:  # aten ops per bucket exchange: no timing; GPU launches where Triton is
        import torch

        from . import bench_ops, report
        if not torch.cuda.is_available():  # the Triton kernels run interpreted on the CPU
            os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            import triton  # noqa: F401
            launch = True
        except ImportError:
            launch = False
        rows = bench_ops.run(launch=launch)
        cols = [("method", "method", ""), ("layout", "layout", ""), ("buckets", "buckets", "d"),
                ("tensors", "tensors", "d"), ("ops_per_step", "ops/step", "d"),
                ("max_ops_per_bucket", "max ops/bucket", "d"),
                ("max_kernel_ops_per_bucket", "max kernel ops/bucket", "d")]
        if launch:
            cols.append(("max_launches_per_bucket", "max GPU launches/bucket", "d"))
        print(report.table(rows, cols))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    try:
        from . import bench_kernels
    except ImportError as exc:
        raise UsageError(f"kernel benchmark unavailable: {exc}") from None
    sizes = tuple(int(float(s)) for s in args.sizes.split(","))
    if not args.max_seconds > 0:
        raise UsageError(f"--max-seconds {args.max_seconds:g}: expected seconds > 0")
    rows = bench_kernels.run(sizes=sizes, device=args.device, max_seconds=args.max_seconds)
    print(bench_kernels.format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


def cmd_plan(args) -> int:
    from . import plan
    from .netlink import parse_rate, parse_time
    if args.check is not None:
        files = args.check or sorted(str(p) for pat in ("ddp_*.json", "latency_*.json")
                                     for p in Path("bench/results").glob(pat))
        if not files:
            raise UsageError("--check: no ddp_*.json or latency_*.json in bench/results; name "
                             "the files")
        for f in files:
            if not Path(f).is_file():
                raise UsageError(f"--check: no such file {f!r}")
        try:
            rows = plan.check(files)
        except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError is a ValueError
            raise UsageError(f"--check: a file is not a gradcomp-bench ddp run: "
                             f"{type(exc).__name__}: {exc}") from None
        if not rows:
            raise UsageError("--check: no row the model covers in " + ", ".join(files))
        print("| run | W | measured s | predicted s | error |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['run']} | {r['world']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} "
                  f"| {r['error']:+.0%} |")
        ok = sum(abs(r["error"]) <= 0.15 for r in rows)
        print(f"\n{ok} of {len(rows)} rows within 15% (ALPHA={plan.ALPHA}, BETA={plan.BETA}, "
              f"fitted on {plan.CALIBRATION})")
        if args.json:
            _write_json(args, Path("."), "plan-check", {"rows": rows})
        return 0
    from .models import MODELS
    if args.model not in MODELS:
        raise UsageError(f"--model {args.model!r}: allowed {', '.join(MODELS)}")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise UsageError(f"--methods {args.methods!r}: expected one or more of "
                         + ", ".join(plan.RATIO))
    for m in methods:
        if m not in plan.RATIO:
            raise UsageError(f"--methods: {m!r} is not modelled; expected one of "
                             + ", ".join(plan.RATIO))
    try:
        worlds = [int(w) for w in args.gpus.split(",")]
    except ValueError:
        raise UsageError(f"--gpus {args.gpus!r}: expected integers >= 2, e.g. 8,64,1024") from None
    if any(w < 2 for w in worlds):
        raise UsageError(f"--gpus {args.gpus!r}: expected integers >= 2, e.g. 8,64,1024")
    try:
        links = [parse_rate(t) for t in args.links.split(",")]
        latency = parse_time(args.latency) if args.latency else 0.0
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not args.compute_ms > 0:
        raise UsageError(f"--compute-ms {args.compute_ms}: expected a positive number of ms")
    rows = plan.project(args.model, methods, worlds, links, args.compute_ms / 1e3, args.device,
                        latency)
    print(f"{args.model}, {args.device}, compute {args.compute_ms:g} ms per step, latency "
          f"{args.latency or '0'}: projected step / compute-only (the fastest in bold)\n")
    print("| ranks | link | " + " | ".join(methods) + " |\n|" + "---|" * (len(methods) + 2))
    for W in worlds:
        for bps in links:
            cell = {r["method"]: r["x_compute"] for r in rows
                    if r["world"] == W and r["link_bps"] == bps}
            best = min(cell, key=cell.get)
            print(f"| {W} | {bps / 1e9:g} Gbit/s | " + " | ".join(
                (f"**{cell[m]:.2f}x**" if m == best else f"{cell[m]:.2f}x") for m in methods) + " |")
    if args.json:
        _write_json(args, Path("."), "plan", {"rows": rows})
    return 0


def cmd_seeds(args) -> int:
    from . import report
    docs = []
    for path in args.files:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: {exc}") from None
        if doc.get("kind") != "convergence":
            raise UsageError(f"{path}: not a convergence run's JSON (kind {doc.get('kind')!r})")
        docs.append(doc)
    try:
        rows = report.over_seeds(docs, args.base)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    fmt = report.markdown if args.markdown else report.table
    lm = any(r.get("val_loss") is not None for d in docs for r in d["rows"])
    print(fmt(rows, report.LM_SEED_COLUMNS if lm else report.SEED_COLUMNS))
    if args.plot and lm:
        from . import plots
        out = Path(args.plot)
        out.mkdir(parents=True, exist_ok=True)
        # one curve per method (its lowest seed's), every run's point on the bytes figure
        curves = {}
        for doc in sorted(docs, key=lambda d: d.get("seed", 0)):
            for method, curve in doc.get("curves", {}).items():
                curves.setdefault(method, curve)
        merged = {"curves": curves, "rows": [r for d in docs for r in d["rows"]]}
        paths = [out / "convergence_val_loss.png", out / "convergence_loss_vs_bytes.png"]
        plots.lm_convergence(merged, *paths)
        print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def cmd_report(args) -> int:
    """RESULTS.md from the rows and the spec, and the README's part the spec's [readme]
    describes (``--readme none``: not the README)."""
    from . import results_report
    out = Path(args.out)
    readme = None if args.readme == "none" else Path(args.readme)
    try:
        text = results_report.build(args.spec)
        readme_text = results_report.readme(args.spec, readme.read_text()) if readme else None
    except (OSError, ValueError, KeyError) as exc:
        raise UsageError(f"{args.spec}: {type(exc).__name__}: {exc}") from None
    files = [(out, text)] + ([(readme, readme_text)] if readme_text is not None else [])
    if args.check:
        stale = [p for p, t in files if not (p.is_file() and p.read_text() == t)]
        for p, _ in files:
            print(f"{p}: " + ("differs from what the rows and the spec give; run "
                              "gradcomp-bench report" if p in stale else "up to date"))
        return 1 if stale else 0
    for p, t in files:
        p.write_text(t)
        print(f"{p}: {len(t.encode())} bytes")
    size = len(text.encode())
    if size > results_report.LIMIT_BYTES:
        print(f"gradcomp-bench: warning: {out} is over {results_report.LIMIT_BYTES} bytes",
              file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradcomp-bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(s, methods, model, batch):
        s.add_argument("--methods", default=methods, help="comma-separated method specs")
        s.add_argument("--model", default=model, help=model_names.help_text(model))
        s.add_argument("--data", default=None, help="CIFAR-10 python-layout directory")
        s.add_argument("--synthetic", action="store_true", help="use synthetic data")
        s.add_argument("--batch", type=int, default=batch,
                       help="per rank" + ("" if batch else " (default: 64 images, 16 sequences)"))
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--delay", type=int, default=0, help="delayed averaging steps")
        s.add_argument("--lanes", type=int, default=4,
                       help="buckets whose exchanges may run at once (one process group each)")
        s.add_argument("--json", default=None, metavar="PATH",
                       help="the run's rows (default OUT/<command>.json), written before plotting")
        s.add_argument("--tensorboard", default=None, metavar="DIR",
                       help="TensorBoard scalars in DIR; convergence also writes each gradcomp "
                            "method's hook diagnostics under DIR/hook/<method> (they cost "
                            "passes over the gradient: step times grow)")
        s.add_argument("--out", default="bench/out", help="directory for plots (and the JSON)")
        s.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                       help="auto: a GPU per rank under NCCL; cuda: GPUs also with gloo ranks")

    d = sub.add_parser("ddp", help="end-to-end step time per method and link")
    common(d, DEFAULT_METHODS, "resnet_small", 32)
    d.add_argument("--world", default="2")
    d.add_argument("--link", default="auto",
                   help="rate(s) of a real shaped link, e.g. 100mbit,1gbit; auto (default): "
                        "100mbit where the machine allows it (root, iproute2), else none "
                        "(loopback)")
    d.add_argument("--latency", default=None, help="one-way delay added on the link, e.g. 50ms")
    d.add_argument("--broadcast-buffers", action="store_true",
                   help="DDP's default: broadcast BatchNorm buffers before every forward (a "
                        "blocking round trip no hook can hide; off by default here)")
    d.add_argument("--barrier", action="store_true",
                   help="a dist.barrier() after every step, as many training loops have")
    d.add_argument("--nodes", type=int, default=None,
                   help="nodes (network namespaces with --link); world = nodes x ranks-per-node")
    d.add_argument("--ranks-per-node", type=int, default=1,
                   help="ranks sharing a node: traffic between them stays off the shaped link; "
                        "LOCAL_WORLD_SIZE is set, so topology=auto goes hierarchical")
    d.add_argument("--parallel", choices=("ddp", "fsdp", "hsdp"), default="ddp",
                   help="language models: DDP, FSDP2 (1-D mesh) or HSDP (shards inside a node "
                        "of --ranks-per-node ranks, replicas across nodes)")
    d.add_argument("--steps", type=int, default=12, help="measured steps after warm-up")
    d.add_argument("--warmup", type=int, default=4)
    d.add_argument("--rounds", type=int, default=1,
                   help="run every method this many times, the order rotated each round; each "
                        "row's ratios are the medians of its rounds' (each against its own "
                        "round's noop)")
    c = sub.add_parser("convergence", help="accuracy per method: CIFAR-10 (SGD), or a GPT's "
                                            "validation loss (AdamW) with --model gpt")
    common(c, CONVERGENCE_METHODS, "resnet18", None)
    c.add_argument("--world", type=int, default=2)
    c.add_argument("--epochs", type=float, default=10)
    c.add_argument("--lr", type=float, default=None,
                   help="CNNs: per rank, the optimizer gets lr x world (default 0.05); language "
                        "models: AdamW's peak lr (default 1e-3)")
    c.add_argument("--steps", type=int, default=2000, help="language models: optimizer steps")
    c.add_argument("--seq-len", type=int, default=None,
                   help="language models: characters per window (default 64, or the model's "
                        "context if shorter)")
    c.add_argument("--optimizer", choices=("auto", "sgd", "adamw"), default="auto",
                   help="auto: SGD for CNNs, AdamW (betas 0.9/0.95, decay 0.1 on matrices) "
                        "for language models")
    c.add_argument("--clip-steps", type=int, default=0,
                   help="language models: clip the gradient norm (at 1.0) only in the first N "
                        "steps (0: every step)")
    c.add_argument("--bf16", action="store_true", help="language models: bf16 autocast (and "
                   "bf16 parameters with fp32 reduction under --parallel fsdp/hsdp)")
    c.add_argument("--parallel", choices=("ddp", "fsdp", "hsdp"), default="ddp",
                   help="language models: DDP, FSDP2 (fully_shard, 1-D mesh) or HSDP (2-D mesh: "
                        "shards inside a node of --ranks-per-node ranks, replicas across)")
    c.add_argument("--ranks-per-node", type=int, default=0,
                   help="--parallel hsdp: ranks per node (the shard group); 0: world/2")
    c.add_argument("--schedule", choices=("cosine", "onecycle"), default="cosine",
                   help="cosine: linear warm-up then cosine; onecycle: torch's OneCycleLR "
                        "(it also cycles momentum), created after register")
    c.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="wall-clock limit per method (default: none; a rank that fails or "
                        "stops still ends the run within about 70 s)")
    o = sub.add_parser("overlap", help="timeline: bucket exchanges during backward")
    o.add_argument("--methods", default="allreduce,dgc:ratio=0.001,onebit,terngrad,powersgd:rank=2")
    o.add_argument("--model", default="resnet18", help=model_names.help_text("resnet18"))
    o.add_argument("--batch", type=int, default=32)
    o.add_argument("--json", default=None, metavar="PATH",
                   help="the run's rows (default OUT/overlap.json), written before plotting")
    o.add_argument("--out", default="bench/out")
    k = sub.add_parser("kernels", help="quantize/select kernels against torch and a copy")
    k.add_argument("--sizes", default="1048576,16777216")
    k.add_argument("--device", default=None)
    k.add_argument("--max-seconds", type=float, default=2.0,
                   help="CPU: time spent on one measurement at most (torch's Timer stops "
                        "earlier once the spread settles)")
    k.add_argument("--json", default=None)
    k.add_argument("--ops", action="store_true",
                   help="count the aten ops of one bucket exchange per method (ResNet-18, "
                        "GPT-2 small, 16 vs 160 tensors) instead of timing kernels")
    e = sub.add_parser("seeds", help="convergence runs of several seeds: one row per method")
    e.add_argument("files", nargs="+", help="convergence JSON files (--json of each run)")
    e.add_argument("--base", default="allreduce",
                   help="the method each seed's differences are taken against")
    e.add_argument("--markdown", action="store_true", help="a Markdown table")
    e.add_argument("--plot", default=None, metavar="DIR",
                   help="language-model runs: the val-loss and val-loss-vs-bytes figures of "
                        "all the files together, into DIR")
    rp = sub.add_parser("report", help="bench/RESULTS.md and README's method table from "
                                        "bench/results/**/*.json and bench/report.toml")
    rp.add_argument("--spec", default="bench/report.toml")
    rp.add_argument("--out", default="bench/RESULTS.md")
    rp.add_argument("--readme", default="README.md",
                    help="the README whose \"Which method to pick\" the spec's [readme] writes "
                         "(none: leave it)")
    rp.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if --out or --readme differs from what the rows "
                         "give")
    pl = sub.add_parser("plan", help="cost model: projected step time per method for 8-1024 "
                                      "ranks and 100 Mbit/s-400 Gbit/s; --check against the "
                                      "rig's measurements")
    pl.add_argument("--check", nargs="*", default=None, metavar="JSON",
                    help="predicted against measured for ddp JSON files (default: "
                         "bench/results/ddp_*.json and latency_*.json)")
    pl.add_argument("--model", default="resnet18")
    pl.add_argument("--device", choices=("h100", "cpu"), default="h100",
                    help="whose codec cost per element (bench/RESULTS.md: Kernels on a GPU, "
                         "Speed on a slow link)")
    pl.add_argument("--compute-ms", type=float, default=12.0,
                    help="the step without communication (default: ResNet-18, batch 32, on "
                         "an H100: 12 ms)")
    pl.add_argument("--gpus", default="8,64,256,1024")
    pl.add_argument("--links", default="100mbit,1gbit,10gbit,100gbit,400gbit")
    pl.add_argument("--latency", default=None, help="one-way latency, e.g. 50us or 5ms")
    pl.add_argument("--methods", default="allreduce,onebit,terngrad,topk,powersgd,dgc,threshold")
    pl.add_argument("--json", default=None, metavar="PATH")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return {"ddp": cmd_ddp, "convergence": cmd_convergence, "kernels": cmd_kernels,
                "overlap": cmd_overlap, "seeds": cmd_seeds, "plan": cmd_plan,
                "report": cmd_report}[args.cmd](args)
    except UsageError as exc:
        print(f"gradcomp-bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ngradcomp-bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
