#!/usr/bin/env bash
# The flywheel's effect on the toy world: the seed-SFT'd policy fine-tuned once more on the
# flywheel's data, and, for comparison, on the seed SFT data of the same questions; both (and the
# seed-SFT'd policy) evaluated on the held-out questions with the real tools, then tabulated.
#
#   bash scripts/flywheel_effect.sh [RUN_DIR]
#
# Needs RUN_DIR (default runs/demo) from the demo up to its flywheel step: toy/, index/, sft/
# and flywheel/ (scripts/flywheel.sh, whose export writes flywheel/sft/seed_sft.jsonl, the seed
# SFT examples of the flywheel's questions). Writes RUN_DIR/sft-flywheel/, sft-seed/, eval/ (the
# seed-SFT'd policy's, when the demo has not written it), eval-flywheel/, eval-seed/ and
# flywheel_effect.md. A finished model or evaluation is not redone. SFT_ARGS reaches both SFT
# runs, EVAL_ARGS every evaluation (Hydra overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
RUN=${1:-runs/demo}

for needed in "$RUN/flywheel/sft/sft.jsonl" "$RUN/flywheel/sft/seed_sft.jsonl" "$RUN/sft/model/config.json" "$RUN/index"; do
  [ -e "$needed" ] || { echo "missing $needed: run bash scripts/demo.sh $RUN (or scripts/flywheel.sh) first" >&2; exit 1; }
done

source scripts/serve_retriever.sh "$RUN/index" "$RUN/retriever.log"
evaluate() {  # MODEL OUT NAME
  # shellcheck disable=SC2086
  python -m etagent.evaluation.run model="$1" files.toy="$RUN/toy/questions/test.jsonl" out_dir="$2" \
    run_name="$3" n=2 tools.search.local.url="$RETRIEVER_URL" ${EVAL_ARGS:-}
}
if [ ! -f "$RUN/eval/summary.md" ]; then
  echo "-- evaluation of $RUN/sft/model on the held-out questions -> $RUN/eval"
  evaluate "$RUN/sft/model" "$RUN/eval" toy-sft
fi
for arm in flywheel seed; do
  data=$RUN/flywheel/sft/sft.jsonl
  [ "$arm" = seed ] && data=$RUN/flywheel/sft/seed_sft.jsonl  # the export's seed examples of the same questions
  if [ ! -f "$RUN/sft-$arm/model/config.json" ]; then
    echo "-- SFT of $RUN/sft/model on $data -> $RUN/sft-$arm"
    # shellcheck disable=SC2086
    python -m etagent.sft.run --preset tiny_flywheel model="$RUN/sft/model" data.path="$data" out_dir="$RUN/sft-$arm" train.progress_bar=false ${SFT_ARGS:-}
  fi
  if [ ! -f "$RUN/eval-$arm/summary.md" ]; then
    echo "-- evaluation of $RUN/sft-$arm on the held-out questions -> $RUN/eval-$arm"
    evaluate "$RUN/sft-$arm/model" "$RUN/eval-$arm" "toy-sft+$arm"
  fi
done
stop_retriever

python -m etagent.evaluation.table "$RUN/eval" "$RUN/eval-seed" "$RUN/eval-flywheel" --out "$RUN/flywheel_effect"
echo "tables: $RUN/flywheel_effect.md, $RUN/flywheel_effect_behaviour.md"
