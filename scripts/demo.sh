#!/usr/bin/env bash
# The main job on the embedded default: every stage of the pipeline on the toy world, on CPU.
#   bash scripts/demo.sh [RUN_DIR]      (default runs/demo; rerunning resumes where it stopped)
# WORLD=hard runs it on the world with headroom (docs/toy-world.md), e.g.
#   WORLD=hard bash scripts/demo.sh runs/hard
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
RUN=${1:-runs/demo}
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

# A policy on the toy world's held-out questions, 2 samples each, with the real tools.
evaluate_on_held_out() {
  local model=$1 out=$2 name=$3
  source scripts/serve_retriever.sh "$RUN/index" "$RUN/retriever.log"
  python -m etagent.evaluation.run model="$model" files.toy="$RUN/toy/questions/test.jsonl" out_dir="$out" \
    run_name="$name" n=2 tools.search.local.url="$RETRIEVER_URL"
  stop_retriever
}

echo "== 1/10 toy world and tiny model -> $RUN/toy"
etagent toy build --world "${WORLD:-toy}" --out "$RUN/toy"

echo
echo "== 2/10 retriever index over the toy corpus -> $RUN/index"
python -m etagent.retriever.build corpus="$RUN/toy/corpus.jsonl" index_dir="$RUN/index"

echo
echo "== 3/10 SFT of the tiny model on the seed trajectories, tool results masked -> $RUN/sft (about 6.5 minutes)"
python -m etagent.sft.run model="$RUN/toy/model" data.path="$RUN/toy/sft.jsonl" out_dir="$RUN/sft" train.progress_bar=false

echo
echo "== 4/10 evaluation of the SFT policy on the held-out questions, with the real tools -> $RUN/eval"
evaluate_on_held_out "$RUN/sft/model" "$RUN/eval" toy-sft
python - "$RUN/eval/toy" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
scored = {row["id"]: row["samples"] for row in map(json.loads, open(out / "scored.jsonl"))}
groups = [g for g in map(json.loads, open(out / "trajectories.jsonl")) if g["source"] in ("toy_both", "toy_hops2")]  # a search then Python; on the hard world, a two-hop chain
# a right answer if the policy gave one (math_equal is the toy's math correctness), else the first
pick = next(((g, i) for g in groups for i, m in enumerate(scored[g["id"]]) if m["math_equal"] == 1.0), (groups[0], 0))
group, i = pick
verdict = "right" if scored[group["id"]][i]["math_equal"] == 1.0 else "wrong"
print(f"\nexample rollout, {verdict} (question: {group['question']}; gold: {group['answer'][0]}):")
print("    " + group["trajectories"][i]["text"].replace("\n", "\n    "))
PY

echo
echo "== 5/10 the data flywheel with the SFT policy: 384 training questions (4 world versions), an initial rollout"
echo "   and 3 rounds of evolution each (no editor model: re-rollouts and trajectory hints), exported as SFT data"
echo "   -> $RUN/flywheel (about 3 minutes)"
PER_KIND=24 bash scripts/flywheel.sh "$RUN/sft/model" "$RUN"

echo
echo "== 6/10 SFT of the SFT policy on the flywheel's data, evaluated on the held-out questions -> $RUN/sft-flywheel,"
echo "   $RUN/eval-flywheel (about 1 minute)"
python -m etagent.sft.run --preset tiny_flywheel model="$RUN/sft/model" data.path="$RUN/flywheel/sft/sft.jsonl" \
  out_dir="$RUN/sft-flywheel" train.progress_bar=false
evaluate_on_held_out "$RUN/sft-flywheel/model" "$RUN/eval-flywheel" toy-sft+flywheel

echo
echo "== 7/10 the RL curriculum, two stages from the flywheel-SFT policy: each stage's data (8 chains per RL-pool"
echo "   question with the stage's starting policy, Pareto selection), RL with ARPO's tree rollout and the"
echo "   efficiency reward, evaluation on the held-out questions -> $RUN/rl_data, $RUN/rl, $RUN/eval-rl-stage*"
echo "   (about 4 minutes per stage)"
bash scripts/rl_curriculum.sh "$RUN/sft-flywheel/model" 2 "$RUN"

echo
echo "== 8/10 the SFT policies against the RL stages on the held-out questions -> $RUN/table"
python -m etagent.evaluation.table "$RUN/eval" "$RUN/eval-flywheel" "$RUN/eval-rl-stage1" "$RUN/eval-rl-stage2" --out "$RUN/table"

echo
echo "== 9/10 radar metrics and chart, the SFT policies against the RL stages -> $RUN/radar"
python -m etagent.radar.run runs="[$RUN/eval,$RUN/eval-flywheel,$RUN/eval-rl-stage1,$RUN/eval-rl-stage2]" \
  labels="[SFT,SFT+flywheel,RL-1,RL-2]" tokenizer="$RUN/sft/model" out_dir="$RUN/radar"

echo
echo "== 10/10 the run's report: every stage, the curves, the tables and charts, and a browser over the"
echo "   trajectories, in one page that opens from disk -> $RUN/report.html"
python -m etagent.report.run "$RUN"

echo
echo "demo finished: outputs in $RUN, the report in $RUN/report.html"
