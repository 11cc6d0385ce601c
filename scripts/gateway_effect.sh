#!/usr/bin/env bash
# The efficiency reward through the gateway against the same through our own agent loop, on the
# toy world: RL from one policy on one RL parquet, with the example harness driving every rollout
# (rollout.kind=gateway) and with our loop (rollout.kind=group), each with the reward's default
# sigmas and with both sigmas 0, SEEDS times each. Then, per arm, the share of rollouts with
# more tool calls than their question needs (redundant) and the raw correctness, early and late
# in the run, mean and spread over the seeds: docs/gateway.md's table.
#
#   bash scripts/gateway_effect.sh POLICY RL_PARQUET QUESTIONS RL_INDEX OUT [SEEDS]
#
# POLICY: an SFT'd toy policy (a demo's RUN/sft-flywheel/model); RL_PARQUET: its RL prompts (a
# demo's RUN/rl_data/stage1/rl.parquet, or any verl parquet of toy questions); QUESTIONS: the
# JSONL they came from (for each question's needed tool calls); RL_INDEX: a retriever index over
# their world. SEEDS defaults to 3 (train.seed). RL_ARGS reaches every run. A finished run is
# not redone. Writes OUT/{gateway,loop}-{efficiency,sigma0}/seed{s}/ and OUT/summary.md.
set -euo pipefail
POLICY=$1 DATA=$2 QUESTIONS=$3 INDEX=$4 OUT=$5
SEEDS=${6:-3}
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
source scripts/serve_retriever.sh "$INDEX" "$OUT/retriever.log"
trap 'stop_retriever' EXIT
HARNESS="$VENV/bin/python $(pwd)/examples/openai_harness.py --retriever $RETRIEVER_URL"

for seed in $(seq 0 $((SEEDS - 1))); do
  for rollout in gateway loop; do
    for reward in efficiency sigma0; do
      dir=$OUT/$rollout-$reward/seed$seed
      if [ -f "$dir/model/config.json" ]; then echo "== $rollout $reward seed $seed: done"; continue; fi
      args=(train.seed="$seed")
      if [ "$rollout" = gateway ]; then args+=(rollout.kind=gateway "rollout.gateway.harness='$HARNESS'"); else args+=(rollout.kind=group); fi
      if [ "$reward" = sigma0 ]; then args+=(reward.sigma_tool=0 reward.sigma_length=0); fi
      mkdir -p "$(dirname "$dir")"
      echo "== $rollout $reward seed $seed -> $dir"
      # shellcheck disable=SC2086
      python -m etagent.rl.run rl_stage=1 model="$POLICY" data.train="$DATA" out_dir="$dir" \
        tools.search.local.url="$RETRIEVER_URL" "${args[@]}" ${RL_ARGS:-} > "$dir.log" 2>&1 || { tail -20 "$dir.log" >&2; exit 1; }
    done
  done
done

python - "$OUT" "$DATA" "$QUESTIONS" "$SEEDS" <<'EOF'
import json, statistics, sys
from pathlib import Path
import pandas as pd

out, data, questions, seeds = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
needed = {q["id"]: sum(q.get("needed_calls", {}).values()) for q in map(json.loads, open(questions))}
by_index = {int(row["index"]): needed[row["question_id"]] for row in pd.read_parquet(data)["extra_info"]}


def phase(run: Path, steps: range) -> tuple[float, float, float]:
    rows = [json.loads(line) for k in steps for line in (run / "rollouts" / f"step_{k}.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["finish_reason"] != "error"]
    return (sum(r["tool_calls"] > by_index[r["index"]] for r in rows) / len(rows), statistics.mean(r["raw"] for r in rows),
            statistics.mean(r["tool_calls"] for r in rows))


def spread(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 else f"{100 * values[0]:.1f}"


lines = ["| rollouts | reward | redundant, steps 1-5 | redundant, last 5 | raw, steps 1-5 | raw, last 5 | calls/rollout, last 5 |", "|---|---|---|---|---|---|---|"]
for arm in ("gateway-efficiency", "gateway-sigma0", "loop-efficiency", "loop-sigma0"):
    runs = [out / arm / f"seed{s}" for s in range(seeds)]
    total = max(int(p.stem.split("_")[1]) for p in (runs[0] / "rollouts").glob("step_*.jsonl"))
    early = [phase(r, range(1, 6)) for r in runs]
    late = [phase(r, range(total - 4, total + 1)) for r in runs]
    rollout, reward = arm.split("-")
    lines.append(f"| {rollout} | {reward} | {spread([e[0] for e in early])} | {spread([e[0] for e in late])} | "
                 f"{spread([e[1] for e in early])} | {spread([e[1] for e in late])} | {statistics.mean(e[2] for e in late):.2f} |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
