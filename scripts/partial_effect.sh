#!/usr/bin/env bash
# Partial rollouts against rollouts to the end, on the toy world: the demo's first RL stage
# (same starting policy, data and step budget) run with rollout.partial off and on, SEEDS
# times each, every final policy evaluated on the 200 held-out questions as the demo evaluates
# them (T=0.6, top-p 0.95, 2 samples); then the ablation table (mean and std over the seeds,
# the per-seed differences, the RL tool calls) and each run's generation time and partial
# metrics.
#
#   bash scripts/partial_effect.sh [RUN_DIR] [SEEDS]
#
# RUN_DIR (default runs/demo) must hold a finished demo (bash scripts/demo.sh RUN_DIR): its
# flywheel-SFT policy, first stage's RL data and both indexes. SEEDS defaults to 3; seed s sets
# RL's train.seed and the evaluation's agent.seed. The partial arm: PARTIAL_ARGS (default
# rollout.partial_extra=4, half a step's prompts; drop past 1 version; stale tokens weighed by
# TIS against the weights that sampled them). Writes RUN_DIR/partial_effect/seed{s}/{to-the-end,
# partial}/ (stage1/rl, eval) and partial_effect/ablations.md. A finished run or evaluation is
# not redone. RL_ARGS reaches both arms' RL runs, EVAL_ARGS every evaluation (Hydra overrides).
set -euo pipefail
RUN=${1:-runs/demo}
SEEDS=${2:-3}
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
POLICY=$RUN/sft-flywheel/model
DATA=$RUN/rl_data/stage1/rl.parquet
for needed in "$POLICY/config.json" "$DATA" "$RUN/index" "$RUN/rl_index"; do
  [ -e "$needed" ] || { echo "missing $needed: run bash scripts/demo.sh $RUN first" >&2; exit 1; }
done
PARTIAL_ARGS=${PARTIAL_ARGS:-rollout.partial_extra=4 rollout.on_stale=drop rollout.max_staleness=1 rollout.stale_tokens=tis}
OUT=$RUN/partial_effect
mkdir -p "$OUT"

source scripts/serve_retriever.sh "$RUN/rl_index" "$OUT/rl_retriever.log"
RL_URL=$RETRIEVER_URL RL_PID=$RETRIEVER_PID
source scripts/serve_retriever.sh "$RUN/index" "$OUT/retriever.log"
EVAL_URL=$RETRIEVER_URL
trap 'kill $RL_PID 2>/dev/null || true; stop_retriever' EXIT

for seed in $(seq 0 $((SEEDS - 1))); do
  for arm in to-the-end partial; do
    dir=$OUT/seed$seed/$arm
    mkdir -p "$dir/stage1"
    if [ -f "$dir/eval/summary.json" ]; then
      echo "== seed $seed, $arm: done"
      continue
    fi
    # shellcheck disable=SC2206
    rl_args=(train.seed="$seed" ${RL_ARGS:-})
    # shellcheck disable=SC2206
    if [ "$arm" = partial ]; then rl_args+=(rollout.partial=true $PARTIAL_ARGS); fi
    echo "== seed $seed, $arm: RL stage 1 from $POLICY -> $dir/stage1/rl"
    python -m etagent.rl.run rl_stage=1 model="$POLICY" data.train="$DATA" out_dir="$dir/stage1/rl" \
      tools.search.local.url="$RL_URL" "${rl_args[@]}" > "$dir/stage1/rl.log" 2>&1 || { tail -20 "$dir/stage1/rl.log" >&2; exit 1; }
    echo "-- evaluation on the held-out questions -> $dir/eval"
    # shellcheck disable=SC2086
    python -m etagent.evaluation.run model="$dir/stage1/rl/model" files.toy="$RUN/toy/questions/test.jsonl" out_dir="$dir/eval" \
      run_name="$arm-seed$seed" n=2 agent.seed="$seed" tools.search.local.url="$EVAL_URL" ${EVAL_ARGS:-} > "$dir/eval.log" 2>&1 || { tail -20 "$dir/eval.log" >&2; exit 1; }
  done
done

python -m etagent.evaluation.ablations "$OUT" --seeds "$SEEDS" --variants to-the-end partial
# generation time and the partial metrics, per run (metrics.jsonl: one line per step)
python - "$OUT" "$SEEDS" <<'PY'
import json
import sys
from pathlib import Path

out, seeds = Path(sys.argv[1]), int(sys.argv[2])
keys = ("timing_s/generate", "timing_s/step", "partial/carried_share", "partial/dropped_share", "partial/stale_token_share")
print(f"{'run':<22}" + "".join(f"{k:>28}" for k in keys) + "   (per step: sums of seconds, means of shares)")
for seed in range(seeds):
    for arm in ("to-the-end", "partial"):
        steps = [json.loads(line) for line in (out / f"seed{seed}" / arm / "stage1" / "rl" / "metrics.jsonl").read_text().splitlines()]
        steps = [s for s in steps if "timing_s/step" in s]
        cells = []
        for k in keys:
            values = [s[k] for s in steps if k in s]
            cells.append("-" if not values else f"{sum(values):.1f}" if k.startswith("timing") else f"{sum(values) / len(values):.3f}")
        print(f"seed {seed} {arm:<15}" + "".join(f"{c:>28}" for c in cells))
PY
