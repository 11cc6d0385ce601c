#!/usr/bin/env bash
# The flywheel's effect on the toy world: the seed-SFT'd policy fine-tuned once more on the
# flywheel's data, and, for comparison, on the seed SFT data of the same questions; both (and the
# seed-SFT'd policy) evaluated on the held-out questions with the real tools, then tabulated.
#
#   bash scripts/flywheel_effect.sh [RUN_DIR]
#
# Needs RUN_DIR (default runs/demo) from the demo up to its flywheel step: toy/, index/, sft/,
# eval/ and flywheel/ (scripts/flywheel.sh). Writes RUN_DIR/flywheel/seed_sft.jsonl, sft-flywheel/,
# sft-seed/, eval-flywheel/, eval-seed/ and flywheel_effect.md. A finished model or evaluation is
# not redone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
RUN=${1:-runs/demo}

echo "-- the seed SFT data of the flywheel's questions -> $RUN/flywheel/seed_sft.jsonl"
python - "$RUN/flywheel/questions.jsonl" "$RUN/toy/sft.jsonl" "$RUN/flywheel/seed_sft.jsonl" <<'PY'
import json, sys
questions = {json.loads(line)["id"] for line in open(sys.argv[1])}
kept = [line for line in open(sys.argv[2]) if json.loads(line)["id"].rsplit("/", 1)[0] in questions]
open(sys.argv[3], "w").writelines(kept)
print(f"   {len(kept)} seed examples of {len(questions)} questions")
PY

source scripts/serve_retriever.sh "$RUN/index" "$RUN/retriever.log"
for arm in flywheel seed; do
  data=$RUN/flywheel/sft/sft.jsonl
  [ "$arm" = seed ] && data=$RUN/flywheel/seed_sft.jsonl
  if [ ! -f "$RUN/sft-$arm/model/config.json" ]; then
    echo "-- SFT of $RUN/sft/model on $data -> $RUN/sft-$arm"
    python -m sft.run --preset tiny_flywheel model="$RUN/sft/model" data.path="$data" out_dir="$RUN/sft-$arm" train.progress_bar=false
  fi
  if [ ! -f "$RUN/eval-$arm/summary.md" ]; then
    echo "-- evaluation of $RUN/sft-$arm on the held-out questions -> $RUN/eval-$arm"
    python -m evaluation.run engine.model="$RUN/sft-$arm/model" files.toy="$RUN/toy/questions/test.jsonl" out_dir="$RUN/eval-$arm" \
      run_name="toy-sft+$arm" n=2 tools.search.local.url="$RETRIEVER_URL"
  fi
done
stop_retriever

python -m evaluation.table "$RUN/eval" "$RUN/eval-seed" "$RUN/eval-flywheel" --out "$RUN/flywheel_effect"
echo "tables: $RUN/flywheel_effect.md, $RUN/flywheel_effect_behaviour.md"
