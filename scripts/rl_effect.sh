#!/usr/bin/env bash
# The paper's effect over seeds, on the toy world: RL stage 1 from the SFT'd policy with the
# efficiency reward (sigma_tool 0.2, sigma_length 0.5) and without it (both 0, as the paper's
# released scripts), SEEDS times each, every policy evaluated on the held-out questions at the
# evaluation's temperature (0.6, top-p 0.95) and at RL's (1.0, no top-p), where the SFT policy
# makes many more redundant calls; then a table of the SFT policy against both settings, mean
# and spread over the seeds.
#
#   bash scripts/rl_effect.sh [RUN_DIR] [SEEDS]
#
# RUN_DIR (default runs/demo) must hold a finished demo's toy world, SFT models, stage-1 data
# and indexes (bash scripts/demo.sh RUN_DIR). SEEDS defaults to 3. RL starts from START (default
# RUN_DIR/sft-flywheel/model, where the demo's curriculum starts), evaluated in START_EVAL
# (default RUN_DIR/eval-flywheel). Writes RUN_DIR/effect/:
# rl-{efficiency,plain}-seed{s}/ (RL runs), eval-{efficiency,plain}-seed{s}/ and
# eval-t1-{efficiency,plain}-seed{s}/ (their evaluations at T=0.6 and T=1), eval-t1-sft/,
# effect.md and effect.json. Every run resumes, so rerunning after a kill continues. About 6
# minutes per RL run and its evaluations on 2 cores. RL_ARGS adds Hydra overrides to every RL run.
set -euo pipefail
RUN=${1:-runs/demo}
SEEDS=${2:-3}
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
START=${START:-$RUN/sft-flywheel/model}
START_EVAL=${START_EVAL:-$RUN/eval-flywheel}
for needed in "$START" "$RUN/rl_data/stage1/rl.parquet" "$START_EVAL/summary.json" "$RUN/index" "$RUN/rl_index"; do
  [ -e "$needed" ] || { echo "missing $needed: run bash scripts/demo.sh $RUN first" >&2; exit 1; }
done
OUT=$RUN/effect
mkdir -p "$OUT"

# held-out questions, 2 samples each: evaluate MODEL OUT NAME SEED [overrides]
evaluate() {
  local model=$1 out=$2 name=$3 seed=$4
  shift 4
  source scripts/serve_retriever.sh "$RUN/index" "$OUT/retriever.log"
  python -m evaluation.run engine.model="$model" files.toy="$RUN/toy/questions/test.jsonl" out_dir="$out" run_name="$name" \
    n=2 seed="$seed" tools.search.local.url="$RETRIEVER_URL" "$@"
  stop_retriever
}
AT_T1=(agent.temperature=1.0 agent.top_p=1.0)

echo "== the SFT policy at T=1 -> $OUT/eval-t1-sft"
evaluate "$START" "$OUT/eval-t1-sft" sft-t1 0 "${AT_T1[@]}"
for seed in $(seq 0 $((SEEDS - 1))); do
  for setting in efficiency plain; do
    if [ "$setting" = efficiency ]; then sigmas=(reward.sigma_tool=0.2 reward.sigma_length=0.5); else sigmas=(reward.sigma_tool=0 reward.sigma_length=0); fi
    echo
    echo "== seed $seed, $setting reward: RL stage 1 from the SFT policy -> $OUT/rl-$setting-seed$seed"
    source scripts/serve_retriever.sh "$RUN/rl_index" "$OUT/rl_retriever.log"
    # shellcheck disable=SC2086
    bash scripts/rl.sh model="$START" data.train="$RUN/rl_data/stage1/rl.parquet" out_dir="$OUT/rl-$setting-seed$seed" \
      train.seed="$seed" "${sigmas[@]}" tools.search.local.url="$RETRIEVER_URL" ${RL_ARGS:-}
    stop_retriever
    echo "-- evaluation on the held-out questions at T=0.6 and at T=1 -> $OUT/eval-$setting-seed$seed, $OUT/eval-t1-$setting-seed$seed"
    evaluate "$OUT/rl-$setting-seed$seed/model" "$OUT/eval-$setting-seed$seed" "$setting-seed$seed" "$seed"
    evaluate "$OUT/rl-$setting-seed$seed/model" "$OUT/eval-t1-$setting-seed$seed" "$setting-t1-seed$seed" "$seed" "${AT_T1[@]}"
  done
done

python - "$RUN" "$SEEDS" "$START_EVAL" <<'PY'
import json, statistics, sys
from pathlib import Path

run, seeds = Path(sys.argv[1]), int(sys.argv[2])
fields = [("correctness", "correctness"), ("efficiency", "efficiency"), ("tool calls", "tool_calls"),
          ("redundant %", "redundant_rate"), ("insufficient %", "insufficient_rate")]

def figures(eval_dir: Path) -> dict:
    toy = json.loads((eval_dir / "summary.json").read_text())["datasets"]["toy"]
    every = toy["behaviour"]["all"]
    return {"correctness": toy["correctness"], "efficiency": toy["efficiency"], **{k: every[k] for k in ("tool_calls", "redundant_rate", "insufficient_rate")}}

def cell(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"

tables, everything = [], {}
for title, prefix, sft in (("T=0.6, top-p 0.95 (the evaluation's sampling)", "eval-", Path(sys.argv[3])),
                           ("T=1.0, no top-p (RL's sampling)", "eval-t1-", run / "effect" / "eval-t1-sft")):
    rows = {"SFT": [figures(sft)]}
    for setting, label in (("efficiency", "RL, efficiency reward (sigmas 0.2 / 0.5)"), ("plain", "RL, sigmas 0 (correctness + format)")):
        rows[label] = [figures(run / "effect" / f"{prefix}{setting}-seed{s}") for s in range(seeds)]
    lines = [f"{title}:", "", "| policy | seeds | " + " | ".join(name for name, _ in fields) + " |", "|---" * (len(fields) + 2) + "|"]
    for label, runs in rows.items():
        lines.append(f"| {label} | {len(runs)} | " + " | ".join(cell([r[key] for r in runs]) for _, key in fields) + " |")
    tables.append("\n".join(lines) + "\n")
    everything[title] = rows
table = "\n".join(tables)
(run / "effect" / "effect.md").write_text(table)
(run / "effect" / "effect.json").write_text(json.dumps(everything, indent=1) + "\n")
print("\nThe held-out questions (200 x 2 samples), mean ± std over seeds:\n")
print(table)
PY
