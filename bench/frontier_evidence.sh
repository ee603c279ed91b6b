#!/usr/bin/env bash
# Local steps at the field's round lengths beside torchft's DiLoCo (bench/RESULTS.md, "Local steps
# and torchft's DiLoCo"): the GPT of "Accuracy with AdamW" (0.8M parameters, AdamW, 2000 steps,
# 2 gloo ranks), one method spec per run. gradcomp's specs write
# bench/results/frontier/gpt2000_s<SEED>_<SPEC>.json, the peer's (torchft-diloco:..., needs
# pip install -e '.[peers]') bench/results/peers/. About 6 minutes a run on 2 quiet cores.
# Usage: bash bench/frontier_evidence.sh SEED SPEC [SPEC ...]
set -euo pipefail
seed=${1:?usage: frontier_evidence.sh SEED SPEC [SPEC ...]}
shift
for spec in "$@"; do
  tag=$(echo "$spec" | sed 's/[,:=]/_/g')
  dir=bench/results/frontier
  case "$spec" in torchft-*) dir=bench/results/peers ;; esac
  gradcomp-bench convergence --model gpt --steps 2000 --seed "$seed" --methods "$spec" \
    --out bench/out/frontier --json "$dir/gpt2000_s${seed}_${tag}.json"
done
