#!/usr/bin/env bash
# Evaluate a policy on benchmarks (evaluation/run.py), then print the table.
#
#   bash scripts/evaluate.sh model=runs/sft/model files.toy=runs/toy/questions/test.jsonl out_dir=runs/eval
#   PRESET=paper bash scripts/evaluate.sh engine.kind=openai engine.openai.urls=[http://127.0.0.1:8011/v1] ...
#
# The retriever must be serving (bash scripts/retriever.sh up), and for the paper preset the
# judge model too (vllm serve Qwen/Qwen2.5-72B-Instruct --port 8051 --tensor-parallel-size 4).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
exec python -m etagent.evaluation.run --preset "${PRESET:-tiny}" "$@"
