#!/usr/bin/env bash
# RL launcher (rl/run.py): one process per GPU through torchrun, FSDP2 across all of them, one
# colocated rollout engine per process.
#
#   bash scripts/rl.sh [overrides]                              one process (CPU, or one GPU)
#   NPROC=4 bash scripts/rl.sh --preset paper [overrides]       4 GPUs of this machine (the paper)
#   NPROC=2 bash scripts/rl.sh [overrides]                      2 processes on CPU (gloo), for testing
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC=8 bash scripts/rl.sh --preset paper ...
#                                                               on every node, NODE_RANK 0..NNODES-1
#
# One process runs through torchrun too when the engine is vllm (engine.kind=vllm: vLLM's external
# launcher needs torchrun's environment); otherwise a single process runs directly.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
NPROC=${NPROC:-1}
NNODES=${NNODES:-1}
uses_vllm() {
  python -c 'import sys, etagent.rl; from etagent.stage_cli import stage_configs; sys.exit(stage_configs("rl", sys.argv[1:], prog="rl")[0].engine.kind != "vllm")' "$@"
}
if [ "$NNODES" -gt 1 ]; then
  : "${NODE_RANK:?set NODE_RANK (0..NNODES-1) on every node}" "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
  exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
    --nproc_per_node "$NPROC" -m etagent.rl.run "$@"
elif [ "$NPROC" -gt 1 ] || uses_vllm "$@"; then
  exec torchrun --standalone --nproc_per_node "$NPROC" -m etagent.rl.run "$@"
else
  exec python -m etagent.rl.run "$@"
fi
