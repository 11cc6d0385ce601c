#!/usr/bin/env bash
# The paper's effect over seeds, on the toy world: RL stage 1 from the SFT policy with the
# efficiency reward (sigma_tool 0.2, sigma_length 0.5) and without it (both 0, as the paper's
# released scripts), SEEDS times each, every policy evaluated on the held-out questions; then a
# table of the SFT policy against both settings, mean and spread over the seeds.
#
#   bash scripts/rl_effect.sh [RUN_DIR] [SEEDS]
#
# RUN_DIR (default runs/demo) must hold a finished demo's toy world, SFT model, stage-1 data
# and indexes (bash scripts/demo.sh RUN_DIR). SEEDS defaults to 3. Writes RUN_DIR/effect/:
# rl-{efficiency,plain}-seed{s}/ (RL runs), eval-{efficiency,plain}-seed{s}/ (their evaluations),
# effect.md and effect.json. Every run resumes, so rerunning after a kill continues. About 5
# minutes per RL run and its evaluation on 2 cores. RL_ARGS adds Hydra overrides to every RL run.
set -euo pipefail
RUN=${1:-runs/demo}
SEEDS=${2:-3}
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
for needed in "$RUN/sft/model" "$RUN/rl_data/stage1/rl.parquet" "$RUN/eval/summary.json" "$RUN/index" "$RUN/rl_index"; do
  [ -e "$needed" ] || { echo "missing $needed: run bash scripts/demo.sh $RUN first" >&2; exit 1; }
done
OUT=$RUN/effect
mkdir -p "$OUT"

for seed in $(seq 0 $((SEEDS - 1))); do
  for setting in efficiency plain; do
    if [ "$setting" = efficiency ]; then sigmas=(reward.sigma_tool=0.2 reward.sigma_length=0.5); else sigmas=(reward.sigma_tool=0 reward.sigma_length=0); fi
    echo
    echo "== seed $seed, $setting reward: RL stage 1 from the SFT policy -> $OUT/rl-$setting-seed$seed"
    source scripts/serve_retriever.sh "$RUN/rl_index" "$OUT/rl_retriever.log"
    # shellcheck disable=SC2086
    bash scripts/rl.sh model="$RUN/sft/model" data.train="$RUN/rl_data/stage1/rl.parquet" out_dir="$OUT/rl-$setting-seed$seed" \
      train.seed="$seed" "${sigmas[@]}" tools.search.local.url="$RETRIEVER_URL" ${RL_ARGS:-}
    stop_retriever
    echo "-- evaluation on the held-out questions -> $OUT/eval-$setting-seed$seed"
    source scripts/serve_retriever.sh "$RUN/index" "$OUT/retriever.log"
    python -m evaluation.run engine.model="$OUT/rl-$setting-seed$seed/model" files.toy="$RUN/toy/questions/test.jsonl" \
      out_dir="$OUT/eval-$setting-seed$seed" run_name="$setting-seed$seed" n=2 seed="$seed" tools.search.local.url="$RETRIEVER_URL"
    stop_retriever
  done
done

python - "$RUN" "$SEEDS" <<'PY'
import json, statistics, sys
from pathlib import Path

run, seeds = Path(sys.argv[1]), int(sys.argv[2])
fields = [("correctness", "correctness"), ("efficiency", "efficiency"), ("tool calls", "tool_calls"),
          ("redundant %", "redundant_rate"), ("insufficient %", "insufficient_rate")]

def figures(eval_dir: Path) -> dict:
    toy = json.loads((eval_dir / "summary.json").read_text())["datasets"]["toy"]
    every = toy["behaviour"]["all"]
    return {"correctness": toy["correctness"], "efficiency": toy["efficiency"], **{k: every[k] for k in ("tool_calls", "redundant_rate", "insufficient_rate")}}

rows = {"SFT": [figures(run / "eval")]}
for setting, label in (("efficiency", "RL, efficiency reward (sigmas 0.2 / 0.5)"), ("plain", "RL, sigmas 0 (correctness + format)")):
    rows[label] = [figures(run / "effect" / f"eval-{setting}-seed{s}") for s in range(seeds)]

def cell(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"

lines = ["| policy | seeds | " + " | ".join(name for name, _ in fields) + " |", "|---" * (len(fields) + 2) + "|"]
for label, runs in rows.items():
    lines.append(f"| {label} | {len(runs)} | " + " | ".join(cell([r[key] for r in runs]) for _, key in fields) + " |")
table = "\n".join(lines) + "\n"
(run / "effect" / "effect.md").write_text(table)
(run / "effect" / "effect.json").write_text(json.dumps(rows, indent=1) + "\n")
print("\nThe held-out questions (200 x 2 samples, T=0.6), mean ± std over seeds:")
print(table)
PY
