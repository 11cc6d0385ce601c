#!/usr/bin/env bash
# The data of RL stage STAGE: direct rollout with MODEL (policy STAGE-1: the SFT model for stage 1,
# the previous stage's RL model after), then Pareto selection, leaving stage{STAGE}/rl.parquet.
#
#   bash scripts/prepare_rl_stage.sh MODEL STAGE [RUN_DIR]
#
# Writes RUN_DIR/rollouts/stage{STAGE}/ (the chains, resumable) and RUN_DIR/rl_data/stage{STAGE}/
# (RUN_DIR defaults to runs/demo): rl.parquet, scores.jsonl, report.json, scatter.png,
# manifest.json. Rerunning resumes the rollout where it stopped and recomputes the selection. (Two
# sibling folders: a stage's output folder never holds its inputs.)
#
# On the toy world (the default) the questions are RUN_DIR/toy/questions/rl.jsonl, asked in a
# world version of their own: its corpus RUN_DIR/toy/rl_world/corpus.jsonl is indexed into
# RUN_DIR/rl_index and served while the rollout runs. Elsewhere, name the questions and a running
# retriever, and pick the presets:
#   PRESET=paper QUESTIONS=data/rl_pool.jsonl SEARCH_URL=http://127.0.0.1:1243 \
#     bash scripts/prepare_rl_stage.sh runs/sft-paper/model 1 runs/paper
# ROLLOUT_ARGS and PARETO_ARGS add Hydra overrides to each step, e.g.
#   ROLLOUT_ARGS="ray.workers=4" PARETO_ARGS="count=4000" bash scripts/prepare_rl_stage.sh ...
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
fi
MODEL=$1
STAGE=$2
RUN=${3:-runs/demo}
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
PRESET=${PRESET:-tiny}
QUESTIONS=${QUESTIONS:-$RUN/toy/questions/rl.jsonl}
OUT=$RUN/rl_data/stage$STAGE
ROLLOUTS=$RUN/rollouts/stage$STAGE
mkdir -p "$RUN/rollouts"

if [ -z "${SEARCH_URL:-}" ]; then
  CORPUS=${CORPUS:-$RUN/toy/rl_world/corpus.jsonl}
  INDEX=${INDEX:-$RUN/rl_index}
  echo "-- retriever over $CORPUS -> $INDEX"
  python -m etagent.retriever.build corpus="$CORPUS" index_dir="$INDEX"
  source scripts/serve_retriever.sh "$INDEX" "$RUN/rollouts/retriever-stage$STAGE.log"
  SEARCH_URL=$RETRIEVER_URL
fi

echo "-- direct rollout of $QUESTIONS with $MODEL -> $ROLLOUTS"
python -m etagent.direct_rollout.run --preset "$PRESET" model="$MODEL" questions="$QUESTIONS" rl_stage="$STAGE" \
  out_dir="$ROLLOUTS" tools.search.local.url="$SEARCH_URL" ${ROLLOUT_ARGS:-}
if [ -n "${RETRIEVER_PID:-}" ]; then stop_retriever; fi

echo "-- Pareto selection -> $OUT/rl.parquet"
python -m etagent.pareto.run --preset "$PRESET" rl_stage="$STAGE" rollouts="$ROLLOUTS" out_dir="$OUT" ${PARETO_ARGS:-}
