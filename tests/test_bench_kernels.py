"""gradcomp-bench kernels: one row per kernel, size and path, timed by the one timer and
printed by the one table function."""
import torch

from gradcomp_bench import bench_kernels, report, timing


def test_timer_summary_orders_its_percentiles_and_counts_calls():
    calls = []
    t = timing.measure(lambda: calls.append(torch.ones(64).sum()), torch.device("cpu"),
                       max_seconds=0.05)
    assert 0 < t["p20_s"] <= t["median_s"] <= t["p80_s"]
    assert t["runs"] >= 1 and len(calls) >= t["runs"]  # warm-up calls are not counted
    assert timing._summary([3.0, 1.0, 2.0, 4.0, 5.0], 5) == {
        "median_s": 3.0, "p20_s": 1.8, "p80_s": 4.2, "runs": 5}


def test_every_kernel_and_path_gets_a_row():
    rows = bench_kernels.run(sizes=(4096,), device="cpu", max_seconds=0.02)
    got = {(r["kernel"], r["path"]) for r in rows}
    for k in ("onebit_compress", "onebit_decompress", "ternary_compress", "ternary_decompress",
              "select_topk", "scatter_add"):
        assert {(k, "copy"), (k, "dispatch"), (k, "reference")} <= got
    assert {("dgc_select", "dispatch"), ("dgc_select", "torch.topk")} <= got
    assert all(r["p20_ms"] <= r["median_ms"] <= r["p80_ms"] and r["repeats"] >= 1 for r in rows)
    text = bench_kernels.format_table(rows).splitlines()
    assert text[0].startswith("device cpu")
    assert len(text) == 1 + 2 + len(rows)  # setup line, header, rule, one line per row


def test_table_aligns_columns_and_prints_missing_values_as_dash():
    out = report.table([{"a": "x", "b": 1.5}, {"a": "long name", "b": None}],
                       [("a", "name", ""), ("b", "value", ".2f")])
    assert out.splitlines() == ["name       value",
                                "---------  -----",
                                "x           1.50",
                                "long name      -"]
