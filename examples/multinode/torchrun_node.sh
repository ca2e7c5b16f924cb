#!/usr/bin/env bash
# Start one machine's share of a multi-machine training job with torchrun; run it on every
# machine with the same settings except NODE_RANK (see docs/multinode.md):
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/multinode/torchrun_node.sh \
#       --sp 8 --model stdit-mini --steps 1000 --output-dir /shared/runs/video   # machine 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/multinode/torchrun_node.sh \
#       --sp 8 --model stdit-mini --steps 1000 --output-dir /shared/runs/video   # machine 1
#
# The flags are train_video.py's (TRAIN_SCRIPT picks another entry point). Settings:
#   NNODES          machines in the job
#   NODE_RANK       this machine, 0 .. NNODES-1 (0 hosts the rendezvous); ignored with RDZV_ID
#   MASTER_ADDR     machine 0's address, reachable from every machine
#   MASTER_PORT     a free TCP port on machine 0, open in its firewall (default 29500)
#   NPROC_PER_NODE  processes per machine (default: the GPUs nvidia-smi lists; set it on CPUs)
#   RDZV_ID         set it (any job id) to use torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT
#                   instead of fixed node ranks: the machines may then start in any order
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${NNODES:?set NNODES, the number of machines}"
: "${MASTER_ADDR:?set MASTER_ADDR, the address of machine 0}"
MASTER_PORT=${MASTER_PORT:-29500}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=0  # no nvidia-smi (a CPU machine) must not end the script under set -e
    if command -v nvidia-smi > /dev/null; then
        NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
    fi
    if [[ "$NPROC_PER_NODE" -eq 0 ]]; then
        echo "no GPU found: set NPROC_PER_NODE (processes on this machine)" >&2
        exit 2
    fi
fi
if [[ -n "${RDZV_ID:-}" ]]; then
    rendezvous=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID")
else
    : "${NODE_RANK:?set NODE_RANK, the index of this machine, 0 .. NNODES-1 (or set RDZV_ID)}"
    rendezvous=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
fi
exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" "${rendezvous[@]}" \
    "${TRAIN_SCRIPT:-scripts/train_video.py}" "$@"
