"""Launches per bucket exchange on a GPU's path, counted without a GPU
(:func:`gradcomp_bench.bench_ops.gpu_launches`): every per-step method at its defaults, the
bucket with the most tensors of ResNet-18 (49 tensors) and of GPT-2 small (11), and 1M
elements cut into 16 and 160 tensors. Rows to ``--json``, a markdown table to stdout.

    PYTHONPATH=. python bench/launches.py --json bench/results/launches_per_bucket.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from gradcomp_bench import bench_ops

METHODS = ("allreduce", "onebit", "terngrad", "topk", "dgc", "threshold", "powersgd")


def layouts() -> dict:
    return {"resnet18": bench_ops.buckets(bench_ops.resnet18_shapes())[1],
            "gpt2-small": bench_ops.buckets(bench_ops.gpt2_small_shapes())[0],
            "16 tensors": bench_ops.buckets(bench_ops.even_shapes(2**20, 16), 2**40)[0],
            "160 tensors": bench_ops.buckets(bench_ops.even_shapes(2**20, 160), 2**40)[0]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--json")
    a = p.parse_args()
    rows, lay = [], layouts()
    for spec in a.methods.split(","):
        for key, layout in lay.items():
            got = bench_ops.gpu_launches(spec, layout)
            rows.append({"method": spec, "layout": key, "tensors": len(layout),
                         "elements": sum(q.numel for q in layout),
                         "launches": sum(got.values()), "by_op": dict(got)})
    keys = list(lay)
    print("| method | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for spec in a.methods.split(","):
        print(f"| `{spec}` | " + " | ".join(str(r["launches"]) for r in rows
                                            if r["method"] == spec) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
