#!/usr/bin/env bash
# The transformer / AdamW recipe of bench/RESULTS.md, "Accuracy with AdamW", under HSDP ("FSDP2 and HSDP"): the GPT
# (0.8M parameters), AdamW, 2000 steps, 4 gloo ranks as 2 nodes x 2 (fully_shard on a 2-D
# mesh), 8 windows per rank (the same 32 per step as the DDP recipe's 2 ranks x 16). One JSON per
# seed and method in bench/results/hsdp/; table: gradcomp-bench seeds bench/results/hsdp/*.json
# Usage: bash bench/hsdp_evidence.sh SEED [METHODS]   (about 15 minutes per method on 2 cores)
set -euo pipefail
seed=${1:-0}
methods=${2:-"allreduce,terngrad,onebit"}
tag=$(echo "$methods" | sed 's/[,:=]/_/g' | cut -c1-60)
mkdir -p bench/results/hsdp
gradcomp-bench convergence --model gpt --steps 2000 --seed "$seed" --methods "$methods" \
  --parallel hsdp --world 4 --ranks-per-node 2 --batch 8 \
  --out bench/out/hsdp --json "bench/results/hsdp/hsdp2000_s${seed}_${tag}.json"
