#!/usr/bin/env bash
# The paper's ablations in miniature, on the toy world: each variant is the RL curriculum from the
# same starting policy with the same step budget, SEEDS times, every final policy evaluated on the
# 200 held-out questions as the demo evaluates them (T=0.6, top-p 0.95, 2 samples); then a table
# of mean and std over the seeds.
#
#   bash scripts/ablations.sh [RUN_DIR] [SEEDS]
#
# RUN_DIR (default runs/demo) must hold a finished demo (bash scripts/demo.sh RUN_DIR): its toy
# world, indexes, seed-SFT policy, flywheel export and flywheel-SFT policy. SEEDS defaults to 3.
# The variants (STAGES curriculum stages of STEPS RL steps each, default 2 and the demo's):
#   full            the pipeline: from the flywheel-SFT policy; per stage, direct rollout, Pareto
#                   selection, RL with ARPO's tree rollout and the efficiency reward
#   no-flywheel     from the seed-SFT policy fine-tuned on the seed data of the flywheel's
#                   questions (as the flywheel-SFT policy is on the flywheel's data of them)
#   no-pareto       as many questions per stage, drawn at random from the same pool
#   no-efficiency   both sigmas 0 (correctness and the format penalty: the paper's released scripts)
#   no-arpo         plain GRPO: n independent rollouts per prompt, as many as the tree makes
#   no-curriculum   one stage of STAGES x STEPS steps on the first stage's data
# A seed s sets the direct rollouts', Pareto's, RL's and the evaluation's seeds. The variants of a
# seed that start from the same policy share its first direct rollout. The starting policies
# (seed-sft, flywheel-sft, seed-data-sft) are evaluated with each seed too, for reference, and so
# is every stage's policy but the last (where the variants differ on the way; on the toy only:
# where the curve is measured, its points at the stages' ends stand in). Writes
# RUN_DIR/ablations/: seed{s}/{variant}/ (stage{k}/rollouts, stage{k}/data, stage{k}/rl,
# stage{k}/eval, eval), sft-seed-data/, ablations.md and ablations.json. Every step resumes, so
# rerunning after a kill continues.
# WORLD (toy or hard; default: the world RUN_DIR/toy was built as, which it must match) sets what is
# measured. On the hard world (docs/toy-world.md "Measured how"): SEEDS defaults to 5, the final
# evaluation asks each of the 500 held-out questions EVAL_N (4) times, and every variant's policy
# is also evaluated at CURVE_POINTS (4) checkpoints per stage, and at its start, on 200 of the
# held-out questions (40 per hop count, 2 samples each): the learning curve, whose area the table
# gives. On the toy: 3 seeds, 2 samples, no curve (CURVE_POINTS=0), as before.
# RL_ARGS adds Hydra overrides to every RL run. SEED_LIST (e.g. "2") runs only those of the SEEDS
# seeds (the table then names the seeds not yet there; run once more without it for the whole
# table). Processes started side by side on one RUN_DIR share the work: each takes the next
# variant (or starting policy's evaluation) of a seed that no other process holds (a lock per one
# in RUN_DIR/ablations/.claims), and waits for a direct rollout that another one is making. On 2
# cores run two, each with one torch thread (docs/reproducibility.md, "Run time"):
#   OMP_NUM_THREADS=1 WORLD=hard bash scripts/ablations.sh runs/hard &
#   OMP_NUM_THREADS=1 WORLD=hard bash scripts/ablations.sh runs/hard; wait
# KEEP (a directory, e.g. results/hard-ablations) keeps each finished run's table inputs there
# (etagent.evaluation.ablation_results: no models) and, before starting, copies back the runs kept
# there from the same starting policies, which are then done: a table that takes longer than one
# sitting is built over several, and can be rebuilt from what is kept.
set -euo pipefail
RUN=${1:-runs/demo}
[ -f "$RUN/toy/manifest.json" ] || { echo "missing $RUN/toy/manifest.json: run bash scripts/demo.sh $RUN first" >&2; exit 1; }
BUILT=$(python3 -c 'import json, sys; print({"toy": "toy", "toy_hard": "hard"}[json.load(open(sys.argv[1]))["stage"]])' "$RUN/toy/manifest.json")
WORLD=${WORLD:-$BUILT}
[ "$WORLD" = "$BUILT" ] || { echo "WORLD=$WORLD, but $RUN/toy holds the $BUILT world (WORLD=$BUILT bash scripts/demo.sh $RUN builds one)" >&2; exit 1; }
if [ "$WORLD" = hard ]; then
  SEEDS=${2:-5} EVAL_N=${EVAL_N:-4} CURVE_POINTS=${CURVE_POINTS:-4}
else
  SEEDS=${2:-3} EVAL_N=${EVAL_N:-2} CURVE_POINTS=${CURVE_POINTS:-0}
fi
LOG_TAG=-$$  # the retrievers' logs of this process (others may run beside it)
SEED_LIST=${SEED_LIST:-$(seq 0 $((SEEDS - 1)))}
for seed in $SEED_LIST; do
  [[ $seed =~ ^[0-9]+$ ]] && [ "$seed" -lt "$SEEDS" ] || { echo "SEED_LIST: seed $seed is not one of the $SEEDS seeds (0 to $((SEEDS - 1)))" >&2; exit 1; }
done
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
STAGES=${STAGES:-2}
FLYWHEEL_POLICY=$RUN/sft-flywheel/model
for needed in "$FLYWHEEL_POLICY/config.json" "$RUN/sft/model/config.json" "$RUN/flywheel/sft/seed_sft.jsonl" "$RUN/index" "$RUN/toy/rl_world/corpus.jsonl"; do
  [ -e "$needed" ] || { echo "missing $needed: run bash scripts/demo.sh $RUN first" >&2; exit 1; }
done
OUT=$RUN/ablations
mkdir -p "$OUT/.claims"
VARIANTS=(full no-flywheel no-pareto no-efficiency no-arpo no-curriculum)
# The demo's stage length: its Pareto count over the prompts per step, times the epochs.
COUNT=$(python -c "import etagent.pareto; from etagent.config import load_config; print(load_config('pareto', 'tiny', []).count)")
STEPS=${STEPS:-$(python - "$COUNT" <<'PY'
import sys
import etagent.rl as _  # registers configs/rl's schema
from etagent.config import load_config
rl = load_config("rl", "tiny", ["model=x", "data.train=x", "out_dir=x"])
print(int(sys.argv[1]) // rl.data.prompts_per_step * rl.data.epochs)
PY
)}
echo "ablations on the $WORLD world: ${#VARIANTS[@]} variants x $SEEDS seeds, $STAGES stages of $STEPS RL steps ($COUNT questions per stage),"
echo "  $EVAL_N samples per held-out question, $CURVE_POINTS curve points per stage -> $OUT"
CURVE_ARGS=()
if [ "$CURVE_POINTS" -gt 0 ]; then
  [ $((STEPS % CURVE_POINTS)) -eq 0 ] || { echo "CURVE_POINTS=$CURVE_POINTS does not divide the $STEPS steps of a stage" >&2; exit 1; }
  CURVE_ARGS=(train.export_every=$((STEPS / CURVE_POINTS)))
  # the curve's questions: every fifth of the held-out file, two in five (it is in shape order, so each hop count gives 40)
  python3 - "$RUN/toy/questions/test.jsonl" "$OUT/curve_questions.jsonl" <<'PY'
import sys
lines = open(sys.argv[1]).readlines()
open(sys.argv[2], "w").writelines(line for i, line in enumerate(lines) if i % 5 < 2)
PY
fi

# What every seed shares: the RL pool's index and the no-flywheel start (the seed-SFT policy
# fine-tuned on the seed data of the flywheel's questions). Processes started side by side
# (SEED_LIST) take turns here: one builds, the others wait and find it built.
exec 9> "$OUT/.shared.lock"
flock 9
python -m etagent.retriever.build corpus="$RUN/toy/rl_world/corpus.jsonl" index_dir="$RUN/rl_index" > /dev/null
if [ ! -f "$OUT/sft-seed-data/model/config.json" ]; then
  echo "== the no-flywheel start: SFT of $RUN/sft/model on $RUN/flywheel/sft/seed_sft.jsonl -> $OUT/sft-seed-data"
  python -m etagent.sft.run --preset tiny_flywheel model="$RUN/sft/model" data.path="$RUN/flywheel/sft/seed_sft.jsonl" \
    out_dir="$OUT/sft-seed-data" train.progress_bar=false
fi
# what kept runs must share with this one (etagent.evaluation.ablation_results refuses others)
BUDGET=(world="$WORLD" stages="$STAGES" steps="$STEPS" eval_n="$EVAL_N" curve_points="$CURVE_POINTS" rl_args="${RL_ARGS:-}")
if [ -n "${KEEP:-}" ] && [ -f "$KEEP/starts.json" ]; then
  python -m etagent.evaluation.ablation_results restore "$KEEP" "$RUN" --settings "${BUDGET[@]}"
fi
flock -u 9
exec 9>&-
# the finished runs' table inputs into KEEP; a save that fails is reported, not fatal: the next
# one saves every finished run not yet kept
keep() {
  [ -z "${KEEP:-}" ] || python -m etagent.evaluation.ablation_results save "$RUN" "$KEEP" --settings "${BUDGET[@]}" \
    || echo "warning: keeping the finished runs in $KEEP failed (the next save tries again)" >&2
}

# Two retrievers per process: the RL pool's world and the held-out questions' world.
source scripts/serve_retriever.sh "$RUN/rl_index" "$OUT/rl_retriever$LOG_TAG.log"
RL_URL=$RETRIEVER_URL RL_PID=$RETRIEVER_PID
source scripts/serve_retriever.sh "$RUN/index" "$OUT/retriever$LOG_TAG.log"
EVAL_URL=$RETRIEVER_URL
trap 'kill $RL_PID 2>/dev/null || true; stop_retriever' EXIT

done_already() { [ -f "$1/manifest.json" ] && grep -q '"status": "complete"' "$1/manifest.json"; }

# claim NAME for this process (fd 8 holds its lock until release): false when another process
# holds it, which then does that work
claim() {
  exec 8> "$OUT/.claims/$1"
  flock -n 8 || { exec 8>&-; return 1; }
}
release() { exec 8>&-; }

# direct rollout of the RL pool with MODEL into DIR, under SEED; a variant of another process that
# shares it (the first stage's, per start) waits for it and finds it done
rollout() {
  local model=$1 dir=$2 seed=$3 k=$4 name=${2#"$OUT"/}
  (
    flock 7
    done_already "$dir" && exit 0
    python -m etagent.direct_rollout.run model="$model" questions="$RUN/toy/questions/rl.jsonl" rl_stage="$k" out_dir="$dir" \
      tools.search.local.url="$RL_URL" agent.seed="$seed"
  ) 7> "$OUT/.claims/rollout-${name//\//-}"
}

# the held-out evaluation of MODEL into DIR/eval, under SEED (QUESTIONS and N: the curve's)
evaluate() {
  local model=$1 dir=$2 name=$3 seed=$4 questions=${5:-$RUN/toy/questions/test.jsonl} n=${6:-$EVAL_N}
  mkdir -p "$dir"
  python -m etagent.evaluation.run model="$model" files.toy="$questions" out_dir="$dir/eval" \
    run_name="$name" n="$n" agent.seed="$seed" tools.search.local.url="$EVAL_URL" > "$dir/eval.log"
}

# the learning curve of a variant in DIR: its start (step 0) and every exported checkpoint of its
# stages, at RL steps counted over the stages, each on the curve's questions
curve() {
  local dir=$1 start_model=$2 seed=$3 stages=$4 steps=$5 variant=$6
  [ "$CURVE_POINTS" -gt 0 ] || return 0
  local point=$dir/curve/step0
  [ -f "$point/eval/summary.json" ] || evaluate "$start_model" "$point" "$variant-step0-seed$seed" "$seed" "$OUT/curve_questions.jsonl" 2
  for k in $(seq 1 "$stages"); do
    # the exported checkpoints, then the stage's last step (RL saves it as model/, not models/step_N)
    for model in "$dir/stage$k/rl/models"/step_* "$dir/stage$k/rl/model"; do
      [ -d "$model" ] || continue
      [[ ${model##*/} =~ ^(model|step_[0-9]+)$ ]] || continue  # not an export a kill left half-written
      local at=$((k * steps))
      [ "${model##*/}" = model ] || at=$(((k - 1) * steps + ${model##*step_}))
      point=$dir/curve/step$at
      [ -f "$point/eval/summary.json" ] || evaluate "$model" "$point" "$variant-step$at-seed$seed" "$seed" "$OUT/curve_questions.jsonl" 2
    done
  done
}

step=0
total=$(($(echo $SEED_LIST | wc -w) * ${#VARIANTS[@]}))
for seed in $SEED_LIST; do
  # the starting policies themselves, for reference: their spread is the evaluation's alone
  for start in seed-sft:$RUN/sft/model flywheel-sft:$FLYWHEEL_POLICY seed-data-sft:$OUT/sft-seed-data/model; do
    name=${start%%:*}
    [ -f "$OUT/seed$seed/$name/eval/summary.json" ] && continue
    claim "seed$seed-$name" || continue
    mkdir -p "$OUT/seed$seed/$name"
    evaluate "${start#*:}" "$OUT/seed$seed/$name" "$name-seed$seed" "$seed"
    release
    keep
  done
  for variant in "${VARIANTS[@]}"; do
    step=$((step + 1))
    dir=$OUT/seed$seed/$variant
    if ! claim "seed$seed-$variant"; then
      echo "== [$step/$total] seed $seed, $variant: another process has it"
      continue
    fi
    mkdir -p "$dir"
    stages=$STAGES steps=$STEPS
    if [ "$variant" = no-curriculum ]; then stages=1 steps=$((STAGES * STEPS)); fi
    if [ -f "$dir/eval/summary.json" ]; then
      echo "== [$step/$total] seed $seed, $variant: done"
    else
      echo
      echo "== [$step/$total] seed $seed, $variant -> $dir"
      model=$FLYWHEEL_POLICY start=flywheel
      if [ "$variant" = no-flywheel ]; then model=$OUT/sft-seed-data/model start=seed-data; fi
      rl_args=(train.seed="$seed" train.max_steps="$steps" "${CURVE_ARGS[@]}")
      case $variant in
        no-efficiency) rl_args+=(reward.sigma_tool=0 reward.sigma_length=0) ;;
        no-arpo) rl_args+=(rollout.kind=group) ;;
      esac
      method=pareto
      if [ "$variant" = no-pareto ]; then method=random; fi
      for k in $(seq 1 "$stages"); do
        mkdir -p "$dir/stage$k"
        rollouts=$dir/stage$k/rollouts
        if [ "$k" = 1 ]; then rollouts=$OUT/seed$seed/$start-stage1-rollouts; fi  # shared by the variants of this start
        echo "-- stage $k/$stages: direct rollout of the pool with $model -> $rollouts"
        rollout "$model" "$rollouts" "$seed" "$k"
        echo "-- stage $k/$stages: selection ($method) -> $dir/stage$k/data"
        python -m etagent.pareto.run rl_stage="$k" rollouts="$rollouts" out_dir="$dir/stage$k/data" method="$method" seed="$seed" > "$dir/stage$k/pareto.log"
        grep -m 1 "^pareto for" "$dir/stage$k/pareto.log"
        echo "-- stage $k/$stages: RL ($steps steps) -> $dir/stage$k/rl"
        # shellcheck disable=SC2086
        python -m etagent.rl.run rl_stage="$k" model="$model" data.train="$dir/stage$k/data/rl.parquet" out_dir="$dir/stage$k/rl" \
          tools.search.local.url="$RL_URL" "${rl_args[@]}" ${RL_ARGS:-}
        model=$dir/stage$k/rl/model
      done
      echo "-- evaluation of $model on the held-out questions -> $dir/eval"
      evaluate "$model" "$dir" "$variant-seed$seed" "$seed"
    fi
    start_model=$FLYWHEEL_POLICY
    if [ "$variant" = no-flywheel ]; then start_model=$OUT/sft-seed-data/model; fi
    curve "$dir" "$start_model" "$seed" "$stages" "$steps" "$variant"
    # every stage's policy but the last, on the held-out questions (also for runs from before they
    # were); not where the curve is measured: its point at each stage's end stands in (200 x 2
    # trajectories in place of 500 x 4)
    if [ "$CURVE_POINTS" -eq 0 ]; then
      for k in $(seq 1 $((stages - 1))); do
        [ -f "$dir/stage$k/eval/summary.json" ] && continue
        echo "-- stage $k/$stages: evaluation of $dir/stage$k/rl/model on the held-out questions -> $dir/stage$k/eval"
        evaluate "$dir/stage$k/rl/model" "$dir/stage$k" "$variant-stage$k-seed$seed" "$seed"
      done
    fi
    release
    keep
  done
done

python -m etagent.evaluation.ablations "$OUT" --seeds "$SEEDS" --references seed-sft seed-data-sft flywheel-sft --variants "${VARIANTS[@]}"
python -m etagent.report.run "$OUT"
