#!/usr/bin/env bash
# The RL curriculum (docs/paper-code.md §C5.5): for k = 1..STAGES, the stage-k data from model k-1 (direct
# rollout and Pareto selection: scripts/prepare_rl_stage.sh), RL stage k from model k-1 (a fresh
# run: its own optimizer, step counter and sigma schedule), then an evaluation of model k.
#
#   bash scripts/rl_curriculum.sh SFT_MODEL [STAGES] [RUN_DIR]
#
# Model 0 is SFT_MODEL; model k is RUN_DIR/rl/stage{k}/model, a plain save_pretrained folder that
# the next stage loads as it is. STAGES defaults to 3 (the paper), RUN_DIR to runs/demo. Writes
# RUN_DIR/rl_data/stage{k}/, RUN_DIR/rl/stage{k}/ and RUN_DIR/eval-rl-stage{k}/. Every step
# resumes, so rerunning after a kill continues where it stopped.
#
# On the toy world (the default) the RL questions come from RUN_DIR/toy (their corpus is served
# from RUN_DIR/rl_index while a stage needs it) and each model is evaluated on the held-out
# questions, 2 samples each, with RUN_DIR/index served. Elsewhere, pick the presets and name the
# services (a retriever for the RL questions, one for the benchmarks):
#   PRESET=paper QUESTIONS=data/rl_pool.jsonl SEARCH_URL=http://127.0.0.1:1243 \
#     EVAL_SEARCH_URL=http://127.0.0.1:1244 NPROC=4 bash scripts/rl_curriculum.sh runs/sft-paper/model 3 runs/paper
# ROLLOUT_ARGS and PARETO_ARGS reach the data steps, RL_ARGS every RL stage, EVAL_ARGS every
# evaluation (Hydra overrides); NPROC and the node variables reach scripts/rl.sh.
set -euo pipefail
if [ $# -lt 1 ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
fi
SFT_MODEL=$1
STAGES=${2:-3}
RUN=${3:-runs/demo}
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
PRESET=${PRESET:-tiny}
RL_PRESET=()
if [ "$PRESET" != tiny ]; then RL_PRESET=(--preset "$PRESET"); fi

model=$SFT_MODEL
for k in $(seq 1 "$STAGES"); do
  echo
  echo "== curriculum stage $k/$STAGES: data from $model -> $RUN/rl_data/stage$k"
  bash scripts/prepare_rl_stage.sh "$model" "$k" "$RUN"

  echo
  echo "== curriculum stage $k/$STAGES: RL from $model -> $RUN/rl/stage$k"
  search_url=${SEARCH_URL:-}
  if [ -z "$search_url" ]; then
    source scripts/serve_retriever.sh "$RUN/rl_index" "$RUN/rl_retriever.log"
    search_url=$RETRIEVER_URL
  fi
  # shellcheck disable=SC2086
  bash scripts/rl.sh "${RL_PRESET[@]}" rl_stage="$k" model="$model" data.train="$RUN/rl_data/stage$k/rl.parquet" \
    out_dir="$RUN/rl/stage$k" tools.search.local.url="$search_url" ${RL_ARGS:-}
  if [ -n "${RETRIEVER_PID:-}" ]; then stop_retriever; fi
  model=$RUN/rl/stage$k/model

  echo
  echo "== curriculum stage $k/$STAGES: evaluation of $model -> $RUN/eval-rl-stage$k"
  eval_url=${EVAL_SEARCH_URL:-}
  toy_files=()
  if [ -z "$eval_url" ]; then
    source scripts/serve_retriever.sh "$RUN/index" "$RUN/retriever.log"
    eval_url=$RETRIEVER_URL
    toy_files=(files.toy="$RUN/toy/questions/test.jsonl" n=2)
  fi
  # shellcheck disable=SC2086
  python -m etagent.evaluation.run --preset "$PRESET" model="$model" out_dir="$RUN/eval-rl-stage$k" run_name="rl-stage$k" \
    "${toy_files[@]}" tools.search.local.url="$eval_url" ${EVAL_ARGS:-}
  if [ -n "${RETRIEVER_PID:-}" ]; then stop_retriever; fi
done
echo
python -m etagent.report.run "$RUN"
echo "curriculum finished: the last stage's model is $model; the run's report is $RUN/report.html"
