"""The cost model (gradcomp_bench/plan.py, ``gradcomp-bench plan``): its formula by hand, the
directions it must move in, reading the rig's JSON, DDP's bucket count, and the CLI."""
import json
from pathlib import Path

import pytest
import torch.distributed as dist

from gradcomp_bench import models, plan
from gradcomp_bench.cli import main


def test_the_step_is_compute_plus_the_exposed_codec_and_link_by_hand():
    c = plan.Case("onebit", 2, compute_s=1.0, codec_s=0.4, wire_bytes=2.5e6, link_bps=1e8,
                  latency_s=0.01, buckets=3)
    # link 0.2 s + 3 buckets x (all_to_all 1 hop + allgather 1 hop) x 10 ms = 0.26 s
    comm = 0.2 + 3 * 2 * 0.01
    assert plan.predict(c) == pytest.approx(1.0 + plan.ALPHA * 0.4 + max(0, comm - plan.BETA))
    c.delay = True  # the next step's compute hides it
    assert plan.predict(c) == pytest.approx(1.0 + plan.ALPHA * 0.4)
    # a round every 4 steps: 10 MB (2.5 MB per step, as the bench spreads it), the round's
    # codec and its exposed link time spread over the 4 steps
    c.delay, c.local_steps = False, 4
    comm = 0.8 + 3 * 2 * 0.01
    assert plan.predict(c) == pytest.approx(1.0 + (plan.ALPHA * 0.4 + comm - plan.BETA) / 4)
    c.local_delay = True  # the next 4 steps hide the round
    assert plan.predict(c) == pytest.approx(1.0 + plan.ALPHA * 0.4 / 4)


def test_hops_grow_with_the_log_of_the_world():
    assert [plan.hops("allreduce", w) for w in (1, 2, 4, 1024)] == [0, 2, 4, 20]
    assert [plan.hops("allgather", w) for w in (2, 8, 1000)] == [1, 3, 10]


def test_the_model_moves_the_right_way():
    base = dict(method="topk", world=2, compute_s=1.0, codec_s=0.3, wire_bytes=4e6,
                link_bps=1e8, latency_s=0.02, buckets=3)
    steps = [plan.predict(plan.Case(**{**base, "link_bps": b})) for b in (1e7, 1e8, 1e9, 1e10)]
    assert steps == sorted(steps, reverse=True) and steps[-1] >= 1.0
    sync = plan.predict(plan.Case(**base))
    assert plan.predict(plan.Case(**base, delay=True)) <= sync
    assert plan.predict(plan.Case(**base, local_steps=8)) < sync
    rows = plan.project("resnet_small", ["allreduce", "topk"], [2, 8, 64], [1e9], 0.01, "h100")
    topk = [r["step_s"] for r in rows if r["method"] == "topk"]
    allreduce = [r["step_s"] for r in rows if r["method"] == "allreduce"]
    assert topk == sorted(topk) and allreduce == sorted(allreduce)  # more ranks: never faster
    # an allgather's bytes per rank grow as W - 1, a ring allreduce's stay under 2x
    assert topk[2] - topk[1] > 5 * (allreduce[2] - allreduce[1])


@pytest.mark.parametrize("name", ["resnet18", "resnet_small", "gpt"])
def test_the_bucket_count_is_ddps(name):
    params = list(models.build(name).parameters())[::-1]
    got, _ = dist._compute_bucket_assignment_by_size(params, [2**20, 25 * 2**20])
    assert plan.ddp_buckets(name) == len(got)


def _rig(tmp_path):
    rows = [
        {"method": "noop", "world": 2, "link_bps": 1e8, "step_s": 1.0},
        {"method": "onebit", "world": 2, "link_bps": 1e8, "step_s": 1.5, "mean_s": 1.6,
         "wire_bytes": 1.8e6, "codec_s": 0.6},
        {"method": "topk:local_steps=4", "world": 2, "link_bps": 1e8, "step_s": 1.0,
         "mean_s": 1.2, "wire_bytes": 1e6, "codec_s": 0.4},
        {"method": "onebit:topology=hierarchical", "world": 4, "link_bps": 1e8,
         "step_s": 3.0, "wire_bytes": 1e6, "codec_s": 0.6},
        {"method": "torch-powersgd:rank=2", "world": 2, "link_bps": 1e8, "step_s": 1.2,
         "wire_bytes": 3e5, "codec_s": None},
    ]
    path = tmp_path / "run.json"
    argv = ["gradcomp-bench", "ddp", "--model", "resnet18", "--latency", "50ms"]
    path.write_text(json.dumps({"kind": "ddp", "argv": argv, "rows": rows}))
    return path


def test_a_rig_json_gives_its_own_inputs_and_skips_what_is_not_modelled(tmp_path):
    cases = plan.rig_cases(_rig(tmp_path))
    assert [label.split(": ")[1] for _, _, label in cases] == ["onebit", "topk:local_steps=4"]
    (one, m1, _), (loc, m2, _) = cases
    assert (one.compute_s, one.codec_s, one.latency_s, one.buckets) == (1.0, 0.6, 0.05, 3)
    assert m1 == 1.5 and m2 == 1.2  # local steps: the mean, which counts the rounds
    assert loc.local_steps == 4 and not loc.delay
    got = plan.check([_rig(tmp_path)])
    assert got[0]["predicted_s"] == pytest.approx(plan.predict(one))
    assert got[0]["error"] == pytest.approx(plan.predict(one) / 1.5 - 1)


def test_a_sweep_takes_each_rows_own_compute_only_step_and_delay_is_gradcomps(tmp_path):
    rows = [{"method": "noop", "world": w, "link_bps": b, "step_s": s}
            for w, b, s in ((2, 1e8, 1.0), (4, 1e8, 2.0), (2, 1e9, 0.9))]
    rows += [{"method": m, "world": w, "link_bps": b, "step_s": 3.0, "wire_bytes": 1e6,
              "codec_s": 0.1} for m in ("onebit", "ddp") for w, b in ((4, 1e8), (2, 1e9))]
    path = tmp_path / "sweep.json"
    argv = ["gradcomp-bench", "ddp", "--model=resnet18", "--latency=0", "--delay", "1"]
    path.write_text(json.dumps({"kind": "ddp", "argv": argv, "rows": rows}))
    got = {(c.method, c.world, c.link_bps): c for c, _, _ in plan.rig_cases(path)}
    assert got["onebit", 4, 1e8].compute_s == 2.0 and got["onebit", 2, 1e9].compute_s == 0.9
    assert got["onebit", 4, 1e8].delay and not got["ddp", 4, 1e8].delay
    assert got["onebit", 4, 1e8].buckets == 3  # --model=resnet18


def test_the_cli_checks_and_projects(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main(["plan", "--check", str(_rig(tmp_path)), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "of 2 rows within 15%" in text and "run.json: onebit" in text
    assert len(json.loads(out.read_text())["rows"]) == 2
    assert main(["plan", "--model", "resnet_small", "--gpus", "8,1024", "--links",
                 "1gbit,400gbit", "--methods", "allreduce,onebit"]) == 0
    table = capsys.readouterr().out
    assert table.count("| 8 |") == 2 and table.count("| 1024 |") == 2 and "**" in table


@pytest.mark.parametrize("args, says", [
    (["--gpus", "8,1"], "--gpus '8,1': expected integers >= 2"),
    (["--links", "3furlongs"], "bad rate '3furlongs'"),
    (["--methods", "allreduce,sparse"], "'sparse' is not modelled"),
    (["--latency", "5 parsecs"], "bad time '5 parsecs'"),
    (["--methods", ","], "--methods ',': expected one or more"),
    (["--model", "nope"], "--model 'nope': allowed"),
    (["--compute-ms", "0"], "--compute-ms 0.0: expected a positive"),
    (["--check", "no/such.json"], "no such file 'no/such.json'"),
    (["--check", "README.md"], "not a gradcomp-bench ddp run"),
])
def test_bad_input_is_refused_by_name(args, says, capsys):
    assert main(["plan", *args]) == 2
    assert says in capsys.readouterr().err


def test_each_rows_compute_is_taken_at_the_pace_the_host_ran_it(tmp_path):
    # this host drifts within a run: a row whose forward took 10% longer than compute-only's
    # ran on a host 10% slower, so its compute-only step is 10% longer; not where the
    # exchange overlaps the next step (delay=1), nor where a forward is not recorded
    rows = [{"method": "noop", "world": 2, "link_bps": 1e8, "step_s": 2.0, "forward_s": 0.6},
            {"method": "onebit", "world": 2, "link_bps": 1e8, "step_s": 2.6, "forward_s": 0.66,
             "wire_bytes": 1e6, "codec_s": 0.3},
            {"method": "dgc:delay=1", "world": 2, "link_bps": 1e8, "step_s": 2.6,
             "forward_s": 0.66, "wire_bytes": 1e6, "codec_s": 0.3},
            {"method": "topk", "world": 2, "link_bps": 1e8, "step_s": 2.6,
             "wire_bytes": 1e6, "codec_s": 0.3}]
    path = tmp_path / "paced.json"
    path.write_text(json.dumps({"kind": "ddp", "argv": ["gradcomp-bench", "ddp"], "rows": rows}))
    got = {c.method: c.compute_s for c, _, _ in plan.rig_cases(path)}
    assert got == {"onebit": pytest.approx(2.2), "dgc": 2.0, "topk": 2.0}


def test_the_fit_finds_the_factors_that_made_the_steps(tmp_path):
    # steps made by the model itself with ALPHA 0.6 and BETA 0.3: the fit gives them back
    rows = [{"method": "noop", "world": 2, "link_bps": 1e8, "step_s": 1.0}]
    for i, (codec, wire) in enumerate([(0.2, 2e6), (0.5, 1e6), (0.1, 5e6), (0.3, 3e5)]):
        c = plan.Case("topk", 2, 1.0, codec, wire, 1e8, 0.0, 3, alpha=0.6, beta=0.3)
        rows.append({"method": f"topk:ratio=0.0{i + 1}", "world": 2, "link_bps": 1e8,
                     "step_s": plan.predict(c), "wire_bytes": wire, "codec_s": codec})
    path = tmp_path / "made.json"
    argv = ["gradcomp-bench", "ddp", "--model", "resnet18"]
    path.write_text(json.dumps({"kind": "ddp", "argv": argv, "rows": rows}))
    assert plan.fit([path]) == (0.6, 0.3)
    with pytest.raises(ValueError, match="no row the model covers"):
        plan.fit([_empty(tmp_path)])


def _empty(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"kind": "ddp", "argv": [], "rows": []}))
    return path


def test_the_shipped_factors_are_the_fit_on_the_calibration_run():
    root = Path(__file__).resolve().parents[1]
    assert plan.fit([root / plan.CALIBRATION]) == (plan.ALPHA, plan.BETA)
