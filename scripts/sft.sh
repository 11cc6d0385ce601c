#!/usr/bin/env bash
# SFT launcher: one process, torchrun or accelerate across GPUs (sft/run.py).
#
#   bash scripts/sft.sh [overrides]                          one process (CPU or one GPU)
#   NPROC=4 bash scripts/sft.sh --preset paper [overrides]   torchrun, 4 processes (ZeRO-3 in the paper preset)
#   LAUNCHER=accelerate NPROC=4 bash scripts/sft.sh ...      accelerate launch, 4 processes
#   NPROC=2 bash scripts/sft.sh ...                          2 processes on CPU (gloo), for testing
#
# Multi-node: add torchrun's --nnodes/--node_rank/--master_addr through TORCHRUN_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
NPROC=${NPROC:-1}
LAUNCHER=${LAUNCHER:-torchrun}
if [ "$NPROC" -le 1 ]; then
  exec python -m etagent.sft.run "$@"
elif [ "$LAUNCHER" = accelerate ]; then
  exec accelerate launch --num_processes "$NPROC" ${ACCELERATE_ARGS:-} -m etagent.sft.run "$@"
else
  exec torchrun --nproc_per_node "$NPROC" ${TORCHRUN_ARGS:-} -m etagent.sft.run "$@"
fi
