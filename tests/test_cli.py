"""gradcomp-bench: bad input is one clear line and exit code 2, never a traceback."""
import json
import subprocess
import sys

import pytest
import torch

from gradcomp_bench import cli


@pytest.mark.parametrize("argv, match", [
    (["ddp", "--methods", "allreduce,nope"], "unknown method 'nope'"),
    (["ddp", "--methods", "topk:ratio=3"], "invalid ratio=3.0"),
    (["ddp", "--methods", "torch-powersgd:rank=two"], "'rank=two' for torch-powersgd: expected an integer"),
    (["ddp", "--methods", "torch-powersgd:ratio=2"], "allowed rank=N, start=N, ordered=N"),
    (["ddp", "--methods", "fp16:rank=2"], "'rank=2' for fp16: allowed none"),
    (["ddp", "--world", "999"], "--world 999 does not fit"),
    (["ddp", "--world", "two"], "expected integers"),
    (["ddp", "--data", "/nonexistent/dir"], "no CIFAR-10 python-layout data in '/nonexistent/dir'"),
    (["ddp", "--link", "fast"], "bad rate 'fast'"),
    (["ddp", "--latency", "50ms"], "--latency needs --link"),
    (["ddp", "--model", "vgg"], "--model 'vgg'"),
    (["convergence", "--timeout", "0"], "--timeout 0: expected seconds > 0"),
    (["ddp", "--world", "3", "--ranks-per-node", "2"], "not a whole number of nodes"),
    (["ddp", "--nodes", "0"], "--nodes 0: allowed an integer >= 1"),
    (["ddp", "--ranks-per-node", "0"], "--ranks-per-node 0: allowed"),
    (["ddp", "--nodes", "99", "--ranks-per-node", "2"], "--world 198 does not fit"),
    (["convergence", "--model", "gpt_tiny", "--seq-len", "64"],
     "--seq-len 64: allowed 1 to 32, the context of --model gpt_tiny"),
])
def test_bad_input_is_one_line_and_exit_2(argv, match, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gradcomp-bench: error:") and match in err[0]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_refused(capsys):
    assert cli.main(["convergence", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda: no CUDA device" in err[0]


def test_ddp_under_torchrun_at_its_defaults(tmp_path):
    """`torchrun ... -m gradcomp_bench.cli ddp` as gpu_check.sh runs it: the default --link
    (auto) means the real network there, not a refusal, and a language model whose context
    is shorter than 128 gets windows of its own context (gpt_tiny: 32)."""
    from conftest import torchrun
    out = tmp_path / "ddp.json"
    torchrun("-m", "gradcomp_bench.cli", "ddp", "--model", "gpt_tiny", "--synthetic",
             "--batch", "4", "--steps", "1", "--warmup", "1", "--methods", "onebit",
             "--device", "cpu", "--json", out, "--out", tmp_path, timeout=240)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["world"], r["link_bps"]) for r in rows] == [("onebit", 2, None)]
    assert 0 < rows[0]["wire_bytes"] < rows[0]["wire_bytes"] * rows[0]["ratio"]


def test_spec_list_splitting_keeps_options_with_their_method():
    assert cli._split_specs("a:x=1,y=2,b,c:z=3") == ["a:x=1,y=2", "b", "c:z=3"]


def test_specs_are_parsed_by_the_library_or_as_a_baseline():
    import gradcomp
    from gradcomp_bench.train import parse_method
    spec = "dgc:ratio=0.01,warmup_steps=30"
    assert parse_method(spec) == gradcomp.parse_spec(spec) == ("dgc", {"ratio": 0.01, "warmup_steps": 30})
    assert parse_method("torch-powersgd:rank=4") == ("torch-powersgd", {"rank": 4, "start": 2, "ordered": 0})
    assert parse_method("noop") == ("noop", {})


def test_installed_console_script_reports_bad_input():
    out = subprocess.run([sys.executable, "-m", "gradcomp_bench.cli", "ddp", "--methods", "bogus"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "unknown method 'bogus'" in out.stderr


def test_convergence_tensorboard_has_the_hooks_own_scalars(tmp_path):
    """--tensorboard: the CLI's curves per method, and for a gradcomp method the hook's own
    per-step scalars (memory norm, PowerSGD's approximation error) under DIR/hook/<method>."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    argv = ["convergence", "--synthetic", "--model", "resnet_small", "--epochs", "0.5",
            "--methods", "allreduce,powersgd:rank=1,min_numel=0,warmup=none", "--tensorboard", str(tb),
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0

    def scalars(d):
        acc = EventAccumulator(str(d))
        acc.Reload()
        return {t: [e.value for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}

    top = scalars(tb)
    assert {"allreduce/test_acc", "powersgd:rank=1,min_numel=0,warmup=none/test_acc"} <= set(top)
    hook = tb / "hook"
    assert sorted(p.name for p in hook.iterdir()) == ["allreduce", "powersgd_rank=1_min_numel=0_warmup=none"]
    ps = scalars(hook / "powersgd_rank=1_min_numel=0_warmup=none")
    steps = len(top["powersgd:rank=1,min_numel=0,warmup=none/compression_ratio"])
    # every step is written (the last one when train() closes the state)
    assert len(ps["gradcomp/approx_error"]) == steps >= 6
    assert all(0 < v < 1 for v in ps["gradcomp/approx_error"])  # rank 1 misses some of M
    assert "gradcomp/residual_energy" not in ps  # PowerSGD's residual is not its own error
    assert all(v > 0 for v in ps["gradcomp/residual_norm"])
    assert "gradcomp/approx_error" not in scalars(hook / "allreduce")


def _conv_doc(path, seed, accs, argv_seed=False):
    import json
    rows = [{"method": m, "test_acc": a, "test_loss": 1.0 + a / 100, "wire_MB": 10.0 * a}
            for m, a in accs.items()]
    doc = {"kind": "convergence", "rows": rows}
    if argv_seed:  # documents written before "seed" was recorded carry it in argv only
        doc["argv"] = ["gradcomp-bench", "convergence", "--seed", str(seed)]
    else:
        doc["seed"] = seed
    path.write_text(json.dumps(doc))
    return str(path)


def test_seeds_table_pairs_each_seed_with_its_own_base(tmp_path, capsys):
    files = [_conv_doc(tmp_path / "a0.json", 0, {"allreduce": 60.0, "dgc": 59.0}),
             _conv_doc(tmp_path / "a1.json", 1, {"allreduce": 50.0, "dgc": 53.0}, argv_seed=True),
             _conv_doc(tmp_path / "b1.json", 1, {"topk:local_steps=8": 48.0}),  # base in a0/a1
             _conv_doc(tmp_path / "b7.json", 7, {"topk:local_steps=8": 70.0})]  # no base: no diff
    assert cli.main(["seeds", *files]) == 0
    out = capsys.readouterr().out
    dgc = next(l for l in out.splitlines() if l.startswith("dgc"))
    # mean accuracy 56.00; per-seed differences -1 and +3: mean +1.00, min -1.00, max +3.00
    assert "56.00" in dgc and "+1.00" in dgc and "-1.00" in dgc and "+3.00" in dgc
    topk = next(l for l in out.splitlines() if l.startswith("topk"))
    assert "1, 7" in topk and "59.00" in topk and "-2.00" in topk  # only seed 1 has a base
    assert cli.main(["seeds", "--markdown", *files[:2]]) == 0
    md = capsys.readouterr().out.splitlines()
    assert md[0].startswith("| method |") and md[2].startswith("| allreduce | 0, 1 | 60.00 / 50.00 |")


def test_seeds_refuses_a_method_twice_for_one_seed_and_other_json(tmp_path, capsys):
    import json
    a = _conv_doc(tmp_path / "a.json", 0, {"allreduce": 60.0})
    b = _conv_doc(tmp_path / "b.json", 0, {"allreduce": 61.0})
    assert cli.main(["seeds", a, b]) == 2
    assert "'allreduce' twice for seed 0" in capsys.readouterr().err
    (tmp_path / "d.json").write_text(json.dumps({"kind": "ddp", "rows": []}))
    assert cli.main(["seeds", a, str(tmp_path / "d.json")]) == 2
    assert "not a convergence run" in capsys.readouterr().err


def test_convergence_keeps_the_other_methods_when_one_fails(tmp_path, monkeypatch, capsys):
    """A method whose ranks fail costs its own row: the others' rows are written (after
    every method), the failure is named, and the exit code says one failed."""
    import json
    from gradcomp_bench import bench
    from gradcomp_bench.launch import RankError

    def fake(world, cfg, timeout=None):
        if cfg.method == "torch-powersgd":
            raise RankError("rank 0 failed:\nTraceback ...\nRuntimeError: [gloo] op.preamble.length"
                            " <= op.nbytes. 1888 vs 532\nrank 1 failed:\nrank 1 exited with code -6",
                            {0: "x", 1: "y"})
        acc = {"allreduce": 0.6, "dgc": 0.55}[cfg.method]
        return [{"test_acc": acc, "test_loss": 1.0, "step_times": [0.1, 0.2], "curve":
                 [{"step": 1, "test_acc": acc, "test_loss": 1.0, "train_loss": 2.0}]}]

    monkeypatch.setattr(bench, "run_train", fake)
    monkeypatch.setattr(cli, "_plot", lambda doc, out: None)
    path = tmp_path / "c.json"
    rc = cli.main(["convergence", "--synthetic", "--methods", "allreduce,torch-powersgd,dgc",
                   "--json", str(path), "--out", str(tmp_path)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "torch-powersgd failed: RuntimeError: [gloo] op.preamble.length" in err
    rows = {r["method"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["dgc"]["d_acc"] == pytest.approx(-5.0)
    assert "1888 vs 532" in rows["torch-powersgd"]["failed"]
    assert cli.main(["seeds", str(path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("torch-powersgd"))
    assert line.split()[-1] == "1"  # runs failed


def test_run_wire_bytes_count_each_exchanged_step_once():
    """With local_steps, stats() repeats the last outer round's record on every inner step:
    the run's bytes count each state step once."""
    rounds = [{"step": s + 1, "rounds": s // 4, "wire_bytes": 1e6 * (s // 4 > 0)}
              for s in range(12)]  # H=4
    assert cli._run_wire_MB(rounds) == 2.0
    plain = [{"step": s, "wire_bytes": 1e6} for s in range(12)]
    assert cli._run_wire_MB(plain) == 12.0
    assert cli._run_wire_MB([]) is None


def test_ddp_wire_bytes_per_step_spread_a_round_over_its_steps():
    from gradcomp_bench import bench
    hist = [{"step": s + 1, "rounds": s // 4, "wire_bytes": 4e6} for s in range(16)]  # H=4
    assert bench.wire_bytes("topk:local_steps=4", {"stats_history": hist}, 2, "resnet_small") == (1e6, True)
    plain = [{"step": s, "wire_bytes": 3e6} for s in range(16)]
    assert bench.wire_bytes("topk", {"stats_history": plain}, 2, "resnet_small") == (3e6, True)


def test_seeds_plot_draws_every_file_together(tmp_path, capsys):
    files = []
    for seed in (0, 1):
        rows = [{"method": m, "val_loss": v + seed / 100, "wire_MB": mb}
                for m, v, mb in (("allreduce", 2.0, 100.0), ("onebit", 2.1, 10.0))]
        doc = {"kind": "convergence", "seed": seed, "rows": rows,
               "curves": {r["method"]: [{"step": 1, "val_loss": r["val_loss"]}] for r in rows}}
        files.append(tmp_path / f"s{seed}.json")
        files[-1].write_text(json.dumps(doc))
    out = tmp_path / "fig"
    assert cli.main(["seeds", "--plot", str(out), *map(str, files)]) == 0
    assert "onebit" in capsys.readouterr().out
    for name in ("convergence_val_loss.png", "convergence_loss_vs_bytes.png"):
        assert (out / name).stat().st_size > 1000


def test_ordered_suffix_is_for_gradcomp_methods_only():
    """``onebit|ordered`` (the rig's side-by-side of gloo's default and NCCL's global order)
    parses as onebit; on a baseline it is refused, naming it."""
    from gradcomp_bench.train import is_gradcomp, parse_method, split_ordered
    assert split_ordered("onebit:chunk=64|ordered") == ("onebit:chunk=64", True)
    assert split_ordered("onebit") == ("onebit", False)
    assert parse_method("onebit:chunk=64|ordered") == parse_method("onebit:chunk=64")
    assert is_gradcomp("terngrad|ordered") and not is_gradcomp("noop")
    with pytest.raises(ValueError, match=r"'noop\|ordered': \|ordered is for gradcomp"):
        parse_method("noop|ordered")


def _fake_ddp_rounds(monkeypatch, tmp_path, fake, rounds):
    """``ddp --methods noop,allreduce,ddp --rounds N`` with ``fake`` in place of the ranks'
    training: (exit code, the JSON it wrote)."""
    from gradcomp_bench import bench
    monkeypatch.setattr(bench, "run_train", fake)
    monkeypatch.setattr(cli, "_plot", lambda doc, out: None)
    path = tmp_path / "r.json"
    code = cli.main(["ddp", "--synthetic", "--link", "none", "--methods", "noop,allreduce,ddp",
                     "--rounds", str(rounds), "--steps", "2", "--warmup", "2", "--json",
                     str(path), "--out", str(tmp_path)])
    return code, json.loads(path.read_text())


def test_ddp_rounds_rotate_the_order_and_pair_each_ratio_with_its_rounds_noop(
        tmp_path, monkeypatch, capsys):
    """--rounds 3: each round runs the methods in an order rotated by one, and a method's
    ratio is the median of its rounds' ratios, each against the noop of its own round (the
    machine slows 10% per run here: unpaired, the drift would decide the ratio)."""
    calls = []

    def fake(world, cfg, link=None, per_node=1):
        slow = 1 + 0.1 * len(calls)
        calls.append(cfg.method)
        base = {"noop": 1.0, "allreduce": 1.2, "ddp": 1.5}[cfg.method]
        # the second round's compute-only ranks had 70% of a core: the machine was busy then
        share = 0.7 if len(calls) == 6 else 1.0
        return [{"step_times": [base * slow] * 4, "cpu_times": [share * base * slow] * 4}]

    code, doc = _fake_ddp_rounds(monkeypatch, tmp_path, fake, 3)
    assert code == 0
    assert calls == ["noop", "allreduce", "ddp", "allreduce", "ddp", "noop",
                     "ddp", "noop", "allreduce"]
    rows = {r["method"]: r for r in doc["rows"]}
    assert [r["method"] for r in doc["rows"]] == ["noop", "allreduce", "ddp"]
    slow = [1 + 0.1 * i for i in range(9)]
    ar = sorted([1.2 * slow[1] / slow[0], 1.2 * slow[3] / slow[5], 1.2 * slow[8] / slow[7]])
    assert rows["allreduce"]["x_compute"] == pytest.approx(ar[1])
    assert (rows["allreduce"]["x_compute_lo"], rows["allreduce"]["x_compute_hi"]) == (
        pytest.approx(ar[0]), pytest.approx(ar[2]))
    assert [r["step_s"] for r in rows["ddp"]["rounds"]] == pytest.approx(
        [1.5 * slow[2], 1.5 * slow[4], 1.5 * slow[6]])
    assert rows["noop"]["x_compute"] == 1.0
    assert [r["cpu_share"] for r in rows["noop"]["rounds"]] == pytest.approx([1.0, 0.7, 1.0])
    assert doc["machine"]["too_busy"] and doc["machine"]["cpu_share"] == pytest.approx(
        0.7 / cli._cores_per_rank([2], False)[2])
    assert sorted(r["round"] for r in doc["raw"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert "x rounds" in capsys.readouterr().out
    assert cli.main(["ddp", "--synthetic", "--rounds", "0"]) == 2


def test_the_floor_and_the_paced_ratio():
    """floor = compute-only + the codec's CPU time + the last bucket's share of the wire
    time (none with delayed averaging: that exchange runs behind the next step); the paced
    ratio counts the step in forwards."""
    from gradcomp_bench import bench
    rows = [{"method": "noop", "world": 2, "link_bps": 1e8, "step_s": 2.0, "mean_s": 2.0,
             "wire_bytes": 0.0, "nocomm_s": 2.0},
            {"method": "onebit", "world": 2, "link_bps": 1e8, "step_s": 2.6, "mean_s": 2.6,
             "wire_bytes": 2.5e6, "nocomm_s": 2.4, "codec_cpu_s": 0.2,
             "last_bucket_share": 0.4},
            {"method": "dgc", "world": 2, "link_bps": 1e8, "step_s": 2.3, "mean_s": 2.3,
             "wire_bytes": 2.5e6, "nocomm_s": 2.1, "codec_cpu_s": 0.1,
             "last_bucket_share": 0.4, "delayed": True}]
    rows[0]["forward_s"], rows[1]["forward_s"], rows[2]["forward_s"] = 0.5, 0.6, 0.6
    bench.finish(rows)
    assert rows[1]["floor_s"] == pytest.approx(2.0 + 0.2 + 0.4 * 0.2)
    # paced: 2.6 / 0.6 forwards against 2.0 / 0.5; none where the exchange runs behind the
    # next step (its forward is not the machine's pace alone)
    assert rows[1]["x_paced"] == pytest.approx((2.6 / 0.6) / 4.0)
    assert "x_paced" not in rows[2]
    assert rows[1]["x_floor"] == pytest.approx(2.6 / 2.28)
    assert rows[2]["floor_s"] == pytest.approx(2.1)
    assert "floor_s" not in rows[0]  # no codec


def test_the_sync_baseline_meets_the_other_rank_once_per_bucket_and_sends_no_gradient(spawn):
    """``sync``: every bucket's hook allreduces a one (both ranks reach it: 2.0 each time) and
    hands back the rank's own gradient, not the average."""
    from gradcomp_bench.train import parse_method
    assert parse_method("sync") == ("sync", {})
    seen, grads, local = zip(*spawn(_sync_ranks, 2, timeout=120))
    # (meetings, the sum of the ranks each found): 2 ranks at each of >= 3 meetings
    assert seen[0] == seen[1] and seen[0][0] >= 3 and seen[0][1] == 2.0 * seen[0][0]
    assert all(not torch.equal(a, b) for a, b in zip(*grads))  # each rank kept its own
    for rank in (0, 1):  # and its own is what plain local backward gives (in the same process)
        assert all(torch.allclose(g, r, rtol=1e-4, atol=1e-6)
                   for g, r in zip(grads[rank], local[rank]))


def _sync_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 600), torch.nn.ReLU(),
                               torch.nn.Linear(600, 600), torch.nn.ReLU(),
                               torch.nn.Linear(600, 10))  # 1.5 MB: past DDP's 1 MB first bucket


def _sync_loss(model, rank):
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 20, generator=g), torch.randint(0, 10, (8,), generator=g)
    return torch.nn.functional.cross_entropy(model(x), y)


def _local_grads(rank):
    net = _sync_net()
    _sync_loss(net, rank).backward()
    return [p.grad for p in net.parameters()]


def _sync_ranks(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from gradcomp_bench.train import SyncState, _sync_hook
    model = DDP(_sync_net(), bucket_cap_mb=0.1)  # several buckets
    state = SyncState()
    model.register_comm_hook(state, _sync_hook)
    for _ in range(2):  # DDP's first backward is one bucket; it splits them after it
        model.zero_grad()
        _sync_loss(model, rank).backward()
    return ((state.meetings, float(state.ranks_total)), [p.grad.clone() for p in model.parameters()],
            _local_grads(rank))


def test_x_sync_paces_each_row_against_the_sync_baseline():
    from gradcomp_bench import bench
    base = {"world": 2, "link_bps": 1e8, "wire_bytes": 0.0}
    rows = [{**base, "method": "noop", "step_s": 2.0, "mean_s": 2.0, "nocomm_s": 2.0,
             "forward_s": 0.5},
            {**base, "method": "sync", "step_s": 2.2, "mean_s": 2.2, "nocomm_s": 2.2,
             "forward_s": 0.5},
            {**base, "method": "onebit", "step_s": 2.6, "mean_s": 2.6, "nocomm_s": 2.6,
             "forward_s": 0.6}]
    bench.finish(rows)
    assert rows[2]["x_sync"] == pytest.approx((2.6 / 0.6) / (2.2 / 0.5))
    assert rows[1]["x_sync"] == 1.0 and rows[1]["x_paced"] == pytest.approx(1.1)


def test_a_run_that_fails_costs_its_row_not_the_others(tmp_path, monkeypatch, capsys):
    """ddp --rounds 2 where one method fails in round 2 (as torch's PowerSGD hook can on
    gloo): the failure is in the JSON and on stderr, every other run is kept, the method's
    row comes from the round it finished, and the command exits 1."""
    from gradcomp_bench.launch import RankError
    calls = []

    def fake(world, cfg, link=None, per_node=1):
        calls.append(cfg.method)
        if cfg.method == "allreduce" and calls.count("allreduce") == 2:
            raise RankError("rank 0 failed:\nTraceback ...\nRuntimeError: collective mismatch",
                            {})
        return [{"step_times": [{"noop": 1.0, "allreduce": 1.2, "ddp": 1.5}[cfg.method]] * 4}]

    code, doc = _fake_ddp_rounds(monkeypatch, tmp_path, fake, 2)
    assert code == 1
    assert len(calls) == 6  # the failure did not stop the runs after it
    assert doc["failed"] == [{"method": "allreduce", "world": 2, "link_bps": None, "round": 1,
                              "error": "RuntimeError: collective mismatch"}]
    rows = {r["method"]: r for r in doc["rows"]}
    assert set(rows) == {"noop", "allreduce", "ddp"}
    assert [r["step_s"] for r in rows["allreduce"]["rounds"]] == [1.2]
    assert rows["ddp"]["x_compute"] == pytest.approx(1.5)
    err = capsys.readouterr().err
    assert "allreduce (world 2, " in err and "round 2) failed: RuntimeError: collective" in err
    assert "1 of 6 runs failed" in err


def _table_rows(x, worlds=(2,), rounds=False):
    """Made-up finished ``ddp`` rows for the default methods: {method: x compute}."""
    rows = []
    for w in worlds:
        for m, ratio in x.items():
            r = {"method": m, "world": w, "link_bps": 1e8, "step_s": ratio, "mean_s": ratio,
                 "p20_s": 0.9 * ratio, "p80_s": 1.1 * ratio, "wire_bytes": 3e6,
                 "bytes_measured": True, "ratio": 17.0, "x_compute": ratio, "x_paced": ratio,
                 "x_bound": 1.1, "x_floor": 1.05, "bound_s": 1.2, "floor_s": 1.1,
                 "codec_s": 0.01, "codec_cpu_s": 0.01, "comm_s": 0.2, "forward_s": 0.1,
                 "breakeven_bps": 1.2e9}
            if rounds:
                r.update(x_compute_lo=ratio - 0.01, x_compute_hi=ratio + 0.01,
                         rounds=[{"step_s": ratio, "x_compute": ratio}] * 3)
            rows.append(r)
    return rows


def test_ddp_table_fits_a_terminal_and_marks_ratios_within_noise():
    """The key columns within 100 characters for the default methods (the rest stays in the
    JSON); a row below compute-only, or nearer to it than compute-only's own step moved
    between its two runs, is marked and footnoted, in the table and in its row."""
    from gradcomp_bench import report
    methods = cli.DEFAULT_METHODS.split(",")
    x = {m: 1.3 for m in methods}
    x.update({"noop": 1.0, "onebit": 0.62, "terngrad": 1.03})
    for worlds, rounds in [((2,), False), ((2,), True), ((2, 4), True)]:
        rows = _table_rows(x, worlds, rounds)
        for r in rows:
            if r["method"] == "noop" and not rounds:
                r["step_after_s"] = 1.05  # compute-only moved 5% between before and after
            elif r["method"] == "noop":
                r["rounds"] = [{"step_s": s, "x_compute": 1.0} for s in (1.0, 0.97, 1.02)]
        report.mark_noise(rows)
        assert {r["method"] for r in rows if r.get("within_noise")} == {"onebit", "terngrad"}
        assert all(r["reference_drift"] == pytest.approx(0.05) for r in rows)
        lines = cli.ddp_table(rows).splitlines()
        assert max(map(len, lines)) <= 100, worlds
        assert ("x rounds" in lines[1 if len(worlds) == 1 else 0]) == rounds
        marked = [ln.split()[0] for ln in lines if "*" in ln and not ln.startswith("*")]
        assert sorted(set(marked)) == ["onebit", "terngrad"]
        note = "\n".join(lines[lines.index(next(ln for ln in lines if ln.startswith("*"))):])
        assert "within noise" in note and "5% (W 2, 100mbit)" in note
        assert "@100M" not in lines[0] + lines[1] and "beats ddp" not in lines[0] + lines[1]
    # measured once: only a ratio below 1 is flagged
    rows = _table_rows({"noop": 1.0, "onebit": 0.9, "topk": 1.01})
    report.mark_noise(rows)
    assert [r.get("within_noise") for r in rows] == [None, True, False]
    assert "*" not in cli.ddp_table(_table_rows({"noop": 1.0, "topk": 1.2}))
    # a paced ratio below 1 is marked as well, with the footnote
    rows = _table_rows({"noop": 1.0, "topk": 1.2})
    rows[1]["x_paced"] = 0.98
    lines = cli.ddp_table(rows).splitlines()
    topk = next(ln for ln in lines if ln.startswith("topk"))
    assert "0.98*" in topk and "1.20 " in topk and lines[5].startswith("* within noise")


def test_ddp_one_round_runs_compute_only_again_after_the_others(tmp_path, monkeypatch, capsys):
    """One round: noop runs again at the end; how far it moved (30% here, the machine slowing
    10% per run) is what a ratio must exceed: allreduce's 1.21 is within it, ddp's 1.8 not."""
    calls = []

    def fake(world, cfg, link=None, per_node=1):
        slow = 1 + 0.1 * len(calls)
        calls.append(cfg.method)
        return [{"step_times": [{"noop": 1.0, "allreduce": 1.1, "ddp": 1.5}[cfg.method] * slow] * 4}]

    code, doc = _fake_ddp_rounds(monkeypatch, tmp_path, fake, 1)
    assert code == 0 and calls == ["noop", "allreduce", "ddp", "noop"]
    rows = {r["method"]: r for r in doc["rows"]}
    assert list(rows) == ["noop", "allreduce", "ddp"]  # the closing run is no row of its own
    assert rows["noop"]["step_after_s"] == pytest.approx(1.3)
    assert rows["allreduce"]["reference_drift"] == pytest.approx(0.3)
    assert (rows["allreduce"]["within_noise"], rows["ddp"]["within_noise"]) == (True, False)
    assert [r.get("after", False) for r in doc["raw"]] == [False, False, False, True]
    assert rows["ddp"]["at_100mbit_s"] > 0  # what left the table stays in the JSON
    out = capsys.readouterr().out
    assert "1.21*" in out and "1.80 " in out and "30% (W 2, loopback)" in out


def test_lanes_go_to_ddp_runs_only():
    """--lanes reaches register() under DDP; under FSDP/HSDP, which refuses it (no effect
    there), it is left out, so --parallel fsdp/hsdp runs register."""
    import argparse
    for parallel, want in (("ddp", {"lanes": 4}), ("fsdp", {}), ("hsdp", {})):
        args = argparse.Namespace(lanes=4, delay=0, parallel=parallel)
        assert cli._delay_opts("onebit", args) == want, parallel
    assert cli._delay_opts("ddp", argparse.Namespace(lanes=4, delay=0, parallel="ddp")) == {}


def _noop(share=None, after=None, drift=None, rounds=None):
    r = {"method": "noop", "world": 2, "link_bps": None, "step_s": 1.0}
    if share is not None:
        r["cpu_share"] = share
    if after is not None:
        r["cpu_share_after"] = after
    if drift is not None:
        r["reference_drift"] = drift
    if rounds:
        r["rounds"] = [{"step_s": 1.0, "x_compute": 1.0, "cpu_share": s} for s in rounds]
    return r


def test_busy_machine_is_told_from_the_compute_only_runs():
    """Too busy: a compute-only rank got under 80% of the core it could have (the smallest
    over its runs: before, after, every round) or compute-only's step moved over 20% between
    its runs; a rank with half a core to itself (4 ranks, 2 cores) is judged against half."""
    from gradcomp_bench import report
    quiet = report.machine_check([_noop(0.97, 0.95, 0.05), {"method": "onebit", "world": 2,
                                                             "link_bps": None, "cpu_share": 0.3}],
                                 load=(0.2, 1.9))
    assert not quiet["too_busy"] and quiet["reasons"] == []
    assert quiet["cpu_share"] == pytest.approx(0.95) and quiet["load_before"] == 0.2
    assert report.busy_warning(quiet) is None
    for rows, cores, why in [([_noop(0.97, 0.52, 0.05)], 1.0, "got 52% of the CPU time"),
                             ([_noop(rounds=[0.99, 0.6, 0.98])], 1.0, "got 60% of the CPU"),
                             ([_noop(0.97, 0.96, 0.31)], 1.0, "moved 31% between its runs"),
                             ([_noop(0.3, 0.31)], 0.5, "got 60% of the CPU time")]:
        got = report.machine_check(rows, cores_per_rank=cores, load=(3.4, 4.1))
        assert got["too_busy"] and any(why in r for r in got["reasons"]), (got, why)
        text = report.busy_warning(got)
        assert text.startswith("WARNING: this machine was too busy to measure") and why in text
        assert "load average 3.4 before the run" in text
        assert max(map(len, text.splitlines())) <= 100
    assert not report.machine_check([_noop(0.45, 0.46, 0.1)], cores_per_rank=0.5)["too_busy"]
    # --world 2,4 on 2 cores: each world judged against its own share of a core
    both = [_noop(0.45, 0.46, 0.1), {**_noop(0.45, 0.46, 0.1), "world": 4}]
    got = report.machine_check(both, cores_per_rank={2: 1.0, 4: 0.5})
    assert got["too_busy"] and got["cpu_share"] == pytest.approx(0.45)
    # nothing measured on the CPU (GPU ranks), one run of compute-only: nothing to judge by
    assert report.machine_check([_noop()]) == {
        "too_busy": False, "reasons": [], "cpu_share": None, "reference_drift": None,
        "thresholds": {"cpu_share": report.BUSY_CPU_SHARE,
                       "reference_drift": report.BUSY_DRIFT}}


def test_cpu_share_is_the_least_any_rank_got_over_the_timed_steps():
    from gradcomp_bench import bench
    ranks = [{"step_times": [5.0, 1.0, 1.0], "cpu_times": [0.1, 0.9, 1.0]},
             {"step_times": [5.0, 1.0, 1.0], "cpu_times": [5.0, 0.5, 0.6]}]
    assert bench.cpu_share(ranks, warmup=1) == pytest.approx(0.55)
    assert bench.cpu_share([{"step_times": [1.0], "cpu_times": None}], warmup=0) is None


def _setup(**kw):
    return {"model": "resnet_small", "parameters": 78042, "grad_MB": 0.312168, "worlds": [2],
            "ranks_per_node": 1, "link": "a real 100mbit link (network namespaces, tc tbf)",
            "batch": 32, "steps": 12, "warmup": 4, "rounds": 1, "device": "auto", "cores": 2,
            **kw}


def test_ddp_table_names_the_model_and_link_and_explains_every_column():
    """Above the table: the model (what it is, its size), the ranks, the link; below it one
    line per column shown; on a busy machine a warning above the table and a line below it."""
    from gradcomp_bench import report
    rows = _table_rows({m: 1.3 for m in cli.DEFAULT_METHODS.split(",")} | {"noop": 1.0})
    for r in rows:
        r["ratio"] = None if r["method"] == "noop" else r["ratio"]
    text = cli.ddp_table(rows, _setup(), report.machine_check([_noop(0.98)]))
    lines = text.splitlines()
    assert lines[0].startswith("resnet_small (a small CIFAR ResNet") and "0.08M parameters" in text
    assert "2 ranks, a real 100mbit link" in text and "batch 32 per rank" in text
    assert "WARNING" not in text and max(map(len, lines)) <= 100
    head = next(ln for ln in lines if ln.startswith("method"))
    shown = [h for h in ("method", "step ms", "p20-p80", "x compute", "x paced", "wire MB",
                         "ratio") if h in head]
    assert shown == ["method", "step ms", "p20-p80", "x compute", "x paced", "wire MB", "ratio"]
    legend = {ln.split(":")[0]: ln for ln in lines if ln.split(":")[0] in shown}
    assert set(legend) == set(shown)
    assert "fp32 allreduce's bytes on the wire per rank / this method's" in legend["ratio"]
    assert "compute-only step (noop" in legend["x compute"]
    busy = report.machine_check([_noop(0.5, 0.97)], load=(2.7, 3.0))
    lines = cli.ddp_table(rows, _setup(), busy).splitlines()
    warn = next(i for i, ln in enumerate(lines) if ln.startswith("WARNING: this machine"))
    assert warn < lines.index(head) and lines[-1].startswith("WARNING: too busy to measure")


def test_ddp_on_a_busy_machine_says_so_in_the_output_and_the_json(tmp_path, monkeypatch, capsys):
    """Ranks that got half a core each (another job beside them): the command prints the
    warning and the JSON's machine says too_busy, with the setup it measured."""
    def fake(world, cfg, link=None, per_node=1):
        step = {"noop": 1.0, "allreduce": 1.1, "ddp": 1.5}[cfg.method]
        return [{"step_times": [step] * 4, "cpu_times": [0.5 * step] * 4}] * world

    code, doc = _fake_ddp_rounds(monkeypatch, tmp_path, fake, 1)
    out = capsys.readouterr().out
    assert code == 0 and doc["machine"]["too_busy"]
    assert doc["machine"]["cpu_share"] == pytest.approx(0.5 / cli._cores_per_rank([2], False)[2])
    assert doc["setup"]["model"] == "resnet_small" and doc["setup"]["link"].startswith("loopback")
    assert "WARNING: this machine was too busy to measure" in out
    assert out.index("WARNING: this machine") < out.index("x compute")
    # the same ranks with a core each: no warning
    def quiet(world, cfg, link=None, per_node=1):
        return [{**r, "cpu_times": r["step_times"]} for r in fake(world, cfg)]

    code, doc = _fake_ddp_rounds(monkeypatch, tmp_path, quiet, 1)
    assert code == 0 and not doc["machine"]["too_busy"]
    assert "WARNING" not in capsys.readouterr().out


def test_the_ratio_column_counts_torchs_hooks_and_ddp_too():
    """fp16 sends half of fp32 allreduce's bytes: ratio 2; DDP's own allreduce 1; noop none."""
    from gradcomp_bench import bench
    res = {"step_times": [1.0] * 3, "config": {"parallel": "ddp"}}
    got = {m: bench.summarize(m, res, 2, None, 1, "resnet_small")["ratio"]
           for m in ("fp16", "ddp", "noop")}
    assert got == {"fp16": pytest.approx(2.0), "ddp": pytest.approx(1.0), "noop": None}


def test_model_help_lists_every_model():
    from gradcomp_bench import model_names, models
    assert set(model_names.DESCRIPTIONS) == set(models.MODELS)
    text = cli.parser()._subparsers._group_actions[0].choices["ddp"].format_help()
    flat = " ".join(text.split())
    for name, what in model_names.DESCRIPTIONS.items():
        assert f"{name}: {what}" in flat
