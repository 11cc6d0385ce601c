#!/usr/bin/env bash
# Build the retrieval index for a corpus and serve it.
#
#   bash scripts/retriever.sh build [overrides]      index the corpus (resumes if interrupted)
#   bash scripts/retriever.sh serve [overrides]      serve it on 127.0.0.1 (foreground)
#   bash scripts/retriever.sh up [overrides]         build if needed, then serve
#
# Defaults (configs/retriever/tiny.yaml): the toy corpus runs/toy/corpus.jsonl -> runs/toy/index,
# port 8000. The paper's setting: PRESET=paper bash scripts/retriever.sh up corpus=... index_dir=...
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
PRESET=${PRESET:-tiny}
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
command=${1:-up}
shift || true
case "$command" in
  build) python -m etagent.retriever.build --preset "$PRESET" "$@" ;;
  serve) exec python -m etagent.retriever.server --preset "$PRESET" "$@" ;;
  up)
    python -m etagent.retriever.build --preset "$PRESET" "$@"
    exec python -m etagent.retriever.server --preset "$PRESET" "$@"
    ;;
  *) echo "usage: $0 build|serve|up [overrides]" >&2; exit 2 ;;
esac
