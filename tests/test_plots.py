"""Figures come from the JSON a run wrote, and that JSON is written before anything is drawn."""
import json
from pathlib import Path

import pytest

from gradcomp_bench import cli, plots

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def test_a_run_that_fails_while_plotting_still_leaves_its_json(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("plotting broke")
    monkeypatch.setattr(plots, "plot", broken)
    out = tmp_path / "run.json"
    argv = ["ddp", "--synthetic", "--link", "none", "--world", "2", "--methods", "noop,topk:ratio=0.01",
            "--steps", "2", "--warmup", "1", "--batch", "8", "--json", str(out),
            "--out", str(tmp_path)]
    with pytest.raises(RuntimeError, match="plotting broke"):
        cli.main(argv)
    doc = json.loads(out.read_text())
    assert doc["kind"] == "ddp"
    assert [r["method"] for r in doc["rows"]] == ["noop", "topk:ratio=0.01"]
    assert all(r["step_s"] > 0 for r in doc["rows"])
    assert len(doc["raw"][0]["step_times"]) == 3
    assert not (tmp_path / "ddp_step_time.png").exists()


def test_without_json_the_rows_go_beside_the_plots(tmp_path):
    argv = ["overlap", "--methods", "allreduce", "--model", "resnet_small", "--batch", "8",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    doc = json.loads((tmp_path / "overlap.json").read_text())
    assert doc["kind"] == "overlap" and doc["rows"][0]["method"] == "allreduce"
    assert (tmp_path / "overlap_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _styles(ax):
    return [(ln.get_label(), ln.get_color(), ln.get_linestyle(), ln.get_marker())
            for ln in ax.get_lines() if not ln.get_label().startswith("_")]


def _check_figure(fig, methods):
    (ax,) = fig.axes
    styles = _styles(ax)
    assert [s[0] for s in styles] == list(methods)
    # no two series look alike (the hand-drawn plot hid onebit under powersgd)
    assert len({s[1:] for s in styles}) == len(styles)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(methods)
    assert any(line.get_visible() for line in ax.get_xgridlines())


def _ddp_labels(methods):
    return ["noop: compute only (measured)" if m == "noop" else f"{m} (projected)"
            for m in methods]


def test_ddp_figure_from_a_recorded_run(tmp_path):
    doc = json.loads((RESULTS / "ddp_resnet18_100mbit.json").read_text())
    fig = plots.ddp(doc, tmp_path / "d.png")
    methods = list(dict.fromkeys(r["method"] for r in doc["rows"]))
    assert {"onebit", "powersgd:rank=2"} <= set(methods)
    _check_figure(fig, _ddp_labels(methods))
    assert (tmp_path / "d.png").stat().st_size > 10_000


def test_ddp_figure_marks_projections_and_draws_none_below_compute_only(tmp_path):
    """A loopback run whose allreduce left less non-communication time than compute-only
    took (noise): its projected line stays on compute-only's, every line says it is
    projected, the title says nothing was measured on a link, and a busy run says so."""
    rows = [{"method": m, "world": 2, "link_bps": None, "step_s": s, "nocomm_s": s,
             "wire_bytes": b} for m, s, b in (("noop", 0.100, 0.0), ("allreduce", 0.095, 4e6),
                                              ("onebit", 0.120, 1.3e5))]
    doc = {"kind": "ddp", "setup": {"model": "resnet_small"}, "rows": rows,
           "machine": {"too_busy": True}}
    fig = plots.ddp(doc, tmp_path / "d.png")
    (ax,) = fig.axes
    _check_figure(fig, _ddp_labels(["noop", "allreduce", "onebit"]))
    for line in ax.get_lines():
        assert min(line.get_ydata()) >= 100.0 - 1e-9, line.get_label()
    title = ax.get_title()
    assert "resnet_small" in title and "never below compute-only" in title
    assert "every line is a projection" in title
    assert any("too busy" in t.get_text() for t in ax.texts)
    doc["machine"]["too_busy"] = False
    assert not plots.ddp(doc, tmp_path / "e.png").axes[0].texts


def test_convergence_figures_from_a_recorded_run(tmp_path):
    doc = json.loads((RESULTS / "convergence_small_10ep.json").read_text())
    acc, loss = plots.convergence(doc, tmp_path / "a.png", tmp_path / "l.png")
    for fig in (acc, loss):
        _check_figure(fig, list(doc["curves"]))
    (ax,) = acc.axes
    first = ax.get_lines()[0]
    curve = next(iter(doc["curves"].values()))
    assert list(first.get_ydata()) == pytest.approx([100 * c["test_acc"] for c in curve])


def test_plots_command_redraws_a_file_and_refuses_what_it_cannot_draw(tmp_path, capsys):
    assert plots.main([str(RESULTS / "ddp_resnet18_100mbit.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "ddp_step_time.png").is_file()
    bad = tmp_path / "kernels.json"
    bad.write_text(json.dumps([{"kernel": "x"}]))
    assert plots.main([str(bad)]) == 2
    assert "not the JSON of gradcomp-bench" in capsys.readouterr().err
