#!/usr/bin/env bash
# GPU checks in one go (one CUDA device): the Triton kernels against the reference, compiled
# natively; the kernels benchmark; every method's hook end to end on the GPU (torchrun, NCCL,
# one rank: the codec runs on the device, the collectives are local).
#
#   OUT=bench/out/gpu bash bench/gpu_check.sh [tests|kernels|ddp ...]
#
# Logs and JSON land in $OUT. Runs from the repository root, without installing (PYTHONPATH).
set -uo pipefail
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=${*:-tests kernels ddp}
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
    ddp)
      timeout 240 torchrun --standalone --nproc-per-node 1 -m gradcomp_bench.cli ddp --model resnet18 \
        --synthetic --batch 128 --steps 20 --warmup 5 \
        --methods ${METHODS:-noop,allreduce,dgc:ratio=0.001,topk:ratio=0.01,onebit,terngrad,powersgd:rank=2} \
        --json "$OUT/ddp_gpu.json" --out "$OUT" 2>&1 | tee "$OUT/ddp_gpu.log" | tail -30 ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
