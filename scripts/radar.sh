#!/usr/bin/env bash
# Radar metrics and chart over one or more evaluation runs (radar/run.py).
#
#   bash scripts/radar.sh runs=[runs/eval] tokenizer=runs/sft/model out_dir=runs/radar
#   PRESET=paper bash scripts/radar.sh runs=[runs/eval-sft,runs/eval-rl] labels=[SFT,RL]
#
# The paper preset asks an LLM judge (vllm serve Qwen/Qwen2.5-72B-Instruct --port 8031); the tiny
# preset judges redundancy with the toy world's oracle.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
exec python -m etagent.radar.run --preset "${PRESET:-tiny}" "$@"
