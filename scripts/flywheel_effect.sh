#!/usr/bin/env bash
# The flywheel's effect on the toy world: the seed-SFT'd policy fine-tuned once more on the
# flywheel's data, and, for comparison, on the seed SFT data of the same questions; both (and the
# seed-SFT'd policy) evaluated on the held-out questions with the real tools, then tabulated.
#
#   bash scripts/flywheel_effect.sh [RUN_DIR]
#
# Needs RUN_DIR (default runs/demo) from the demo up to its flywheel step: toy/, index/, sft/,
# eval/ and flywheel/ (scripts/flywheel.sh, whose export writes flywheel/sft/seed_sft.jsonl, the
# seed SFT examples of the flywheel's questions). Writes RUN_DIR/sft-flywheel/, sft-seed/,
# eval-flywheel/, eval-seed/ and flywheel_effect.md. A finished model or evaluation is not redone.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
RUN=${1:-runs/demo}

for needed in "$RUN/flywheel/sft/sft.jsonl" "$RUN/flywheel/sft/seed_sft.jsonl" "$RUN/eval/summary.json" "$RUN/index"; do
  [ -e "$needed" ] || { echo "missing $needed: run bash scripts/demo.sh $RUN (or scripts/flywheel.sh) first" >&2; exit 1; }
done

source scripts/serve_retriever.sh "$RUN/index" "$RUN/retriever.log"
for arm in flywheel seed; do
  data=$RUN/flywheel/sft/sft.jsonl
  [ "$arm" = seed ] && data=$RUN/flywheel/sft/seed_sft.jsonl  # the export's seed examples of the same questions
  if [ ! -f "$RUN/sft-$arm/model/config.json" ]; then
    echo "-- SFT of $RUN/sft/model on $data -> $RUN/sft-$arm"
    python -m etagent.sft.run --preset tiny_flywheel model="$RUN/sft/model" data.path="$data" out_dir="$RUN/sft-$arm" train.progress_bar=false
  fi
  if [ ! -f "$RUN/eval-$arm/summary.md" ]; then
    echo "-- evaluation of $RUN/sft-$arm on the held-out questions -> $RUN/eval-$arm"
    python -m etagent.evaluation.run model="$RUN/sft-$arm/model" files.toy="$RUN/toy/questions/test.jsonl" out_dir="$RUN/eval-$arm" \
      run_name="toy-sft+$arm" n=2 tools.search.local.url="$RETRIEVER_URL"
  fi
done
stop_retriever

python -m etagent.evaluation.table "$RUN/eval" "$RUN/eval-seed" "$RUN/eval-flywheel" --out "$RUN/flywheel_effect"
echo "tables: $RUN/flywheel_effect.md, $RUN/flywheel_effect_behaviour.md"
