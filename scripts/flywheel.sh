#!/usr/bin/env bash
# The self-evolving data flywheel with MODEL as the policy, then its export to SFT data.
#
#   bash scripts/flywheel.sh MODEL [RUN_DIR]
#
# Writes RUN_DIR/flywheel/ (RUN_DIR defaults to runs/demo): trajectories.jsonl and manifest.json
# (resumable: a rerun skips the questions already written; on the toy world one such folder per
# world version, vV/), sft/ (sft.jsonl for sft/, report.json, llamafactory/).
#
# On the toy world (the default) the seed questions are the first PER_KIND (default 32) training
# questions of each kind in each world version of VERSIONS (default "1 2 3 4"), written to
# RUN_DIR/flywheel_questions/vV.jsonl; each version's corpus (RUN_DIR/toy/training_worlds/V.jsonl)
# is indexed into RUN_DIR/flywheel_index/vV and served while its questions are evolved into
# RUN_DIR/flywheel/vV, and the versions are exported together, compared with the seed SFT data
# of the same questions (RUN_DIR/toy/sft.jsonl). Elsewhere, name the questions and a running
# retriever, and pick the preset:
#   PRESET=paper QUESTIONS=data/flywheel_seed.jsonl SEARCH_URL=http://127.0.0.1:1243 \
#     FLYWHEEL_ARGS="engine.openai.urls=[...] editor.engine.openai.urls=[...]" bash scripts/flywheel.sh Qwen/Qwen2.5-7B-Instruct runs/paper
# FLYWHEEL_ARGS and EXPORT_ARGS add Hydra overrides to each step, e.g. an editor model in this
# process: FLYWHEEL_ARGS="editor.enabled=true editor.engine.model=/path/to/model.gguf".
set -euo pipefail
if [ $# -lt 1 ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
fi
MODEL=$1
RUN=${2:-runs/demo}
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
PRESET=${PRESET:-tiny}
OUT=$RUN/flywheel
mkdir -p "$OUT"
EXPORT=()

run_flywheel() {  # QUESTIONS SEARCH_URL OUT_DIR
  echo "-- flywheel over $1 with $MODEL -> $3"
  python -m etagent.flywheel.run --preset "$PRESET" model="$MODEL" questions="$1" out_dir="$3" \
    tools.search.local.url="$2" ${FLYWHEEL_ARGS:-}
}

if [ -n "${QUESTIONS:-}" ]; then
  : "${SEARCH_URL:?with QUESTIONS, set SEARCH_URL to a retriever serving their corpus}"
  run_flywheel "$QUESTIONS" "$SEARCH_URL" "$OUT"
else
  # The toy world's training questions are asked in several versions of the world (same names,
  # redrawn facts), each with its own corpus: each version's questions are evolved while a
  # retriever serves that version, each into its own (resumable) output, then exported together.
  mkdir -p "$RUN/flywheel_questions"
  runs=()
  for version in ${VERSIONS:-1 2 3 4}; do
    questions=$RUN/flywheel_questions/v$version.jsonl
    python - "$RUN/toy/questions/train.jsonl" "$questions" "$version" "${PER_KIND:-32}" <<'PY'
import json, sys
from collections import Counter
source, target, version, per_kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
taken, lines = Counter(), []
for line in open(source):
    q = json.loads(line)
    if q.get("world_version") == version and taken[q["source"]] < per_kind:
        taken[q["source"]] += 1
        lines.append(line)
open(target, "w").writelines(lines)
print(f"-- world version {version}: the first {per_kind} training questions of each kind: {len(lines)} {dict(taken)}")
PY
    python -m etagent.retriever.build corpus="$RUN/toy/training_worlds/$version.jsonl" index_dir="$RUN/flywheel_index/v$version"
    source scripts/serve_retriever.sh "$RUN/flywheel_index/v$version" "$RUN/flywheel_index/v$version.log"
    run_flywheel "$questions" "$RETRIEVER_URL" "$OUT/v$version"
    stop_retriever
    runs+=("$OUT/v$version/trajectories.jsonl")
  done
  EXPORT=("export.seed_data=$RUN/toy/sft.jsonl" "export.trajectories=[$(IFS=,; echo "${runs[*]}")]" "export.out_dir=$OUT/sft")
fi

echo "-- export to SFT data -> $OUT/sft"
python -m etagent.flywheel.export --preset "$PRESET" out_dir="$OUT" "${EXPORT[@]}" ${EXPORT_ARGS:-}
