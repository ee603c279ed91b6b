#!/usr/bin/env bash
# The transformer / AdamW evidence of bench/RESULTS.md, "Accuracy with AdamW": the GPT (0.8M parameters) on
# the pycode corpus, AdamW, 2000 steps, 2 gloo ranks, every method at its defaults beside
# allreduce, torch's PowerSGD hook and the ablation adam=off. One JSON per seed and method
# group in bench/results/gpt/; the table: gradcomp-bench seeds bench/results/gpt/*.json
# Usage: [STEPS=N] bash bench/gpt_evidence.sh SEED [METHODS]   (2000 steps by default: about 4
# minutes per method on 2 cores)
set -euo pipefail
seed=${1:-0}
methods=${2:-"allreduce,onebit,topk,powersgd,terngrad,threshold,dgc,torch-powersgd:rank=2,ordered=1,onebit:adam=off"}
steps=${STEPS:-2000}
tag=$(echo "$methods" | sed 's/[,:=]/_/g' | cut -c1-60)
gradcomp-bench convergence --model gpt --steps "$steps" --seed "$seed" --methods "$methods" \
  --out bench/out/gpt --json "bench/results/gpt/gpt${steps}_s${seed}_${tag}.json"
