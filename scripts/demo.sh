#!/usr/bin/env bash
# The main job on the embedded default: every stage of the pipeline on the toy world, on CPU.
#   bash scripts/demo.sh [RUN_DIR]      (default runs/demo; rerunning resumes where it stopped)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ETAGENT_VENV:-.venv}
RUN=${1:-runs/demo}
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

echo "== 1/1 toy world and tiny model -> $RUN/toy"
etagent toy build --out "$RUN/toy"

echo
echo "demo finished: outputs in $RUN"
