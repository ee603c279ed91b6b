"""``gradcomp-bench report``: bench/RESULTS.md is what the recorded rows and bench/report.toml
give, byte for byte; it stays a report (small, no words about how the work was organised);
a new GPT run is a new row with no code change; the paced ratios it recomputes for older runs
are the harness's own."""
import json
import re
import shutil
from pathlib import Path

import pytest

from gradcomp_bench import cli, results_report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "RESULTS.md"
README = ROOT / "README.md"
SPEC = ROOT / "bench" / "report.toml"
PROCESS = re.compile(r"\bsessions?\b|\bissue [0-9]+|the issue's|\bs[0-9]{2}\b|was lent"
                     r"|farm-(studio|bench)", re.I)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "RESULTS.md"
    assert cli.main(["report", "--spec", str(SPEC), "--out", str(out), "--readme", "none"]) == 0
    return out.read_bytes()


def test_results_md_is_what_the_rows_give(written):
    assert written == RESULTS.read_bytes(), (
        "bench/RESULTS.md differs from what bench/results/**/*.json and bench/report.toml give: "
        "run `gradcomp-bench report`")


def test_check_flag_tells_an_edited_file(tmp_path, capsys):
    copy, readme = tmp_path / "RESULTS.md", tmp_path / "README.md"
    copy.write_bytes(RESULTS.read_bytes())
    readme.write_bytes(README.read_bytes())
    argv = ["report", "--spec", str(SPEC), "--out", str(copy), "--readme", str(readme), "--check"]
    assert cli.main(argv) == 0
    copy.write_text(RESULTS.read_text().replace("| `onebit` |", "| `onebit ` |", 1))
    assert cli.main(argv) == 1
    assert "RESULTS.md: differs" in capsys.readouterr().out
    copy.write_bytes(RESULTS.read_bytes())
    readme.write_text(README.read_text().replace("| `onebit` | -0.4 |", "| `onebit` | -0.3 |"))
    assert readme.read_text() != README.read_text()
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "README.md: differs" in out and "RESULTS.md: up to date" in out


def test_readme_method_table_is_what_the_rows_give():
    assert results_report.readme(SPEC, README.read_text()) == README.read_text(), (
        "README.md's \"Which method to pick\" differs from what bench/results/**/*.json and "
        "bench/report.toml's [readme] give: run `gradcomp-bench report`")


def test_readme_figures_come_from_the_rows_only(tmp_path):
    """No figure is typed into the README's template (every percentage, ratio and point
    difference is a {source method metric format}); a figure moves when its rows move; a
    figure the rows lack is an error that names it."""
    import tomllib
    spec = tomllib.loads(SPEC.read_text())
    bare = results_report.FIGURE.sub("", spec["readme"]["text"])
    typed = re.findall(r"[-+]?\d+(?:\.\d+)?(?:%|x\b| points)", bare)
    assert not typed, typed
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "bench" / "results", root / "bench" / "results")
    shutil.copy(SPEC, root / "bench" / "report.toml")
    run = root / "bench" / "results" / "convergence_narrow18_defaults_12ep_s0.json"
    doc = json.loads(run.read_text())
    for r in doc["rows"]:
        if r["method"] == "onebit":
            r["test_acc"] += 3.0  # one seed of three: the mean moves by one point
    run.write_text(json.dumps(doc))
    block = results_report.readme_block(spec, root)
    assert "| `onebit` | +0.6 |" in block and "| `onebit` | -0.4 |" in README.read_text()
    spec["readme"]["text"] += "{sgd onebit no_such_metric .1f}"
    with pytest.raises(results_report.SpecError, match="no no_such_metric for 'onebit'"):
        results_report.readme_block(spec, root)


def test_report_is_small_and_speaks_of_measurements_only(written):
    assert len(written) < results_report.LIMIT_BYTES, f"RESULTS.md is {len(written)} bytes"
    text = written.decode()
    for name, body in (("RESULTS.md", text), ("report.toml", SPEC.read_text())):
        hits = sorted({m.group(0) for m in PROCESS.finditer(body)})
        assert not hits, f"{name}: {hits}"
    # every section of the spec is there, each listed in the contents with a working anchor
    heads = re.findall(r"^## (.*)$", text, re.M)
    assert heads == ["Speed on a slow link", "Accuracy with SGD", "Accuracy with AdamW",
                     "FSDP2 and HSDP", "Kernels on a GPU", "Kernels on the CPU", "Long runs"]
    for h in heads:
        assert f"(#{results_report.slug(h)})" in text
    for fig in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (ROOT / "bench" / fig).is_file(), fig


def test_means_over_seeds_show_every_seed(written):
    text = written.decode()
    # the SGD defaults: three seeds each, against allreduce of the same seed
    row = next(line for line in text.splitlines() if line.startswith("| `onebit` | 0, 1, 2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    per_seed = [float(x) for x in cells[2].split(" / ")]
    assert cells[3] == f"{sum(per_seed) / 3:.2f}"
    # the step-time runs: the mean of every run's paced ratio
    row = next(line for line in text.splitlines() if line.startswith("| `dgc` | 1.086 /"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    runs = [float(x) for x in cells[1].split(" / ")]
    assert len(runs) == 3 and cells[2] == f"{sum(runs) / 3:.2f}"


def _gpt(path: Path, seed: int, steps: int, rows: list[dict]):
    path.write_text(json.dumps({
        "kind": "convergence", "seed": seed, "curves": {}, "rows": rows,
        "argv": ["gradcomp-bench", "convergence", "--model", "gpt", "--steps", str(steps),
                 "--seed", str(seed)]}))


def test_a_new_gpt_run_is_a_new_row_without_code(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "bench" / "results", root / "bench" / "results")
    shutil.copy(SPEC, root / "bench" / "report.toml")
    shutil.copy(ROOT / "bench" / "longrun.py", root / "bench" / "longrun.py")
    gpt = root / "bench" / "results" / "gpt"
    _gpt(gpt / "gpt2000_s0_newcomer.json", 0, 2000,
         [{"method": "newcomer", "val_loss": 1.6, "wire_MB": 100.0}])
    _gpt(gpt / "gpt600_s7_allreduce_newcomer2.json", 7, 600,  # (a seed no stored run has)
         [{"method": "allreduce", "val_loss": 2.0, "wire_MB": 900.0},
          {"method": "newcomer2", "val_loss": 2.1, "wire_MB": 90.0},
          {"method": "newcomer2:outer_lr=0.5", "val_loss": 1.9, "wire_MB": 90.0}])
    text = results_report.build(root / "bench" / "report.toml")
    gpt_part = text.split("## Accuracy with AdamW", 1)[1].split("\n## ", 1)[0]
    tables = re.split(r"^(\d+ steps, .*):$", gpt_part, flags=re.M)[1:]
    tables = dict(zip(tables[::2], tables[1::2]))
    assert list(tables)[:3] == ["600 steps, every method at its defaults",
                                "600 steps, with options",
                                "2000 steps, every method at its defaults"]
    base = json.loads((gpt / "gpt2000_s0_allreduce.json").read_text())["rows"][0]["val_loss"]
    assert f"| `newcomer` | 0 | 1.6000 | 1.6000 | {100 * (1.6 / base - 1):+.2f} |" in (
        tables["2000 steps, every method at its defaults"])
    assert "| `newcomer2` | 7 | 2.1000 | 2.1000 | +5.00 |" in (
        tables["600 steps, every method at its defaults"])
    assert "`newcomer2:outer_lr=0.5`" in tables["600 steps, with options"]
    assert "newcomer2" not in tables["2000 steps, every method at its defaults"]
    # ordered by the result: the new 600-step table lists allreduce, then newcomer2
    assert tables["600 steps, every method at its defaults"].index("`allreduce`") < (
        tables["600 steps, every method at its defaults"].index("`newcomer2`"))
    # the same inputs give the same bytes
    assert results_report.build(root / "bench" / "report.toml") == text


@pytest.mark.parametrize("name", ["ddp_resnet18_100mbit_s50_sync.json",
                                  "ddp_resnet18_100mbit_s50_third.json"])
def test_paced_ratio_from_raw_rows_is_the_harness_own(name):
    """Older runs' rows lack ``x_paced``; the report recomputes it from their raw rows. On runs
    that recorded it, the recomputation gives back what ``bench.finish`` stored."""
    doc = json.loads((ROOT / "bench" / "results" / name).read_text())
    raw = results_report.paced_from_raw(doc)
    for r in doc["rows"]:
        assert sorted(raw[r["method"]])[1] == pytest.approx(r["x_paced"], rel=1e-12), r["method"]


def test_a_missing_file_is_an_error(tmp_path, capsys):
    spec = tmp_path / "bench" / "report.toml"
    spec.parent.mkdir()
    spec.write_text('title = "t"\n[[section]]\ntitle = "s"\n[[section.table]]\nkind = "single"\n'
                    'files = ["bench/results/none_*.json"]\ncolumns = ["step_ms"]\n')
    assert cli.main(["report", "--spec", str(spec), "--out", str(tmp_path / "R.md")]) == 2
    assert "no file matches" in capsys.readouterr().err
