#!/usr/bin/env bash
# GPU checks in one go (one CUDA device): the Triton kernels against the reference, compiled
# natively; the kernels benchmark; every method's hook end to end on the GPU (torchrun, NCCL,
# one rank: the codec runs on the device, the collectives are local), in a ResNet-18 step
# (ddp) and a GPT-2-small step with AdamW (gpt); a torch.profiler table of one DDP step per
# method, its kernel launches counted (profile); the host waits of every method's compressed
# steps under DDP and FSDP2 with torch.cuda.set_sync_debug_mode (sync); DGC's segmented select
# step by step, the radix selects against the sorts (select).
#
#   OUT=bench/out/gpu bash bench/gpu_check.sh [tests|kernels|select|ddp|gpt|profile|sync ...]
#
# Logs and JSON land in $OUT. Runs from the repository root, without installing (PYTHONPATH).
set -uo pipefail
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=${*:-tests kernels select ddp gpt profile sync}
run="python3 -m torch.distributed.run --standalone --nproc-per-node 1"
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for s in $steps; do
  echo "=== $s"
  case $s in
    tests)
      TRITON_INTERPRET=0 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
        2>&1 | tee "$OUT/test_kernels_gpu.log" | tail -25 ;;
    kernels)
      timeout 240 python3 -m gradcomp_bench.cli kernels --sizes ${SIZES:-1048576,25000000} \
        --json "$OUT/kernels_gpu.json" 2>&1 | tee "$OUT/kernels_gpu.log" ;;
    select)
      timeout 120 python3 -m gradcomp_bench.gpu_probe select 2>&1 | tee "$OUT/select_gpu.log" ;;
    ddp)
      timeout 240 $run -m gradcomp_bench.cli ddp --model resnet18 \
        --synthetic --batch 128 --steps 20 --warmup 5 \
        --methods ${METHODS:-noop,allreduce,dgc:ratio=0.001,topk:ratio=0.01,onebit,terngrad,threshold,powersgd:rank=2} \
        --json "$OUT/ddp_gpu.json" --out "${PLOTS:-$OUT}" 2>&1 | tee "$OUT/ddp_gpu.log" | tail -30 ;;
    gpt)  # each method at its defaults, as a user's first AdamW run gets them
      timeout 240 $run -m gradcomp_bench.cli ddp --model gpt2_small \
        --synthetic --batch 8 --steps 10 --warmup 3 \
        --methods ${GPT_METHODS:-noop,allreduce,dgc,topk,onebit,terngrad,threshold,powersgd} \
        --json "$OUT/gpt_gpu.json" --out "${PLOTS:-$OUT}" 2>&1 | tee "$OUT/gpt_gpu.log" | tail -30 ;;
    profile)
      timeout 180 python3 -m gradcomp_bench.gpu_probe \
        "profile=${PROFILE_METHODS:-dgc:ratio=0.001;topk:ratio=0.01;onebit;terngrad;threshold;powersgd:rank=2}" \
        2>&1 | tee "$OUT/profile_gpu.log" | grep -E "^==|cudaLaunchKernel|Self CPU time total|Self CUDA time total|syncs" ;;
    sync)  # host waits in compressed steps, every method, DDP and FSDP2 (sync-debug "warn")
      SYNC_JSON="$OUT/syncdebug_gpu.json" timeout 180 python3 -m gradcomp_bench.gpu_probe syncdebug \
        2>&1 | tee "$OUT/syncdebug_gpu.log" | grep -vE "^\s+warnings.warn|UserWarning" | tail -80 ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
