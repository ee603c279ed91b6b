#!/usr/bin/env bash
# gradcomp across nodes: the same script under torchrun on each node. On node i of N:
#   NNODES=N NODE_RANK=i MASTER=host-of-node-0:29500 bash examples/multinode.sh --method onebit
# GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME pick the interface where a node has several.
# The tests run it as 2 "nodes" on one machine (1 process each, MASTER=127.0.0.1:PORT).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec python -m torch.distributed.run --nnodes "${NNODES:-2}" --node-rank "${NODE_RANK:-0}" \
    --nproc-per-node "${NPROC_PER_NODE:-1}" --master-addr "${MASTER%:*}" \
    --master-port "${MASTER##*:}" "$here/ddp.py" "$@"
