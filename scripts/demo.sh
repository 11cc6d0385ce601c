#!/usr/bin/env bash
# The main job on the embedded default: every stage of the pipeline on the toy world, on CPU.
#   bash scripts/demo.sh [RUN_DIR]      (default runs/demo; rerunning resumes where it stopped)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ETAGENT_VENV:-.venv}
RUN=${1:-runs/demo}
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

echo "== 1/3 toy world and tiny model -> $RUN/toy"
etagent toy build --out "$RUN/toy"

echo
echo "== 2/3 retriever index over the toy corpus -> $RUN/index"
python -m retriever.build corpus="$RUN/toy/corpus.jsonl" index_dir="$RUN/index"

echo
echo "== 3/3 tools: the retriever service and the Python sandbox"
PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python -m retriever.server index_dir="$RUN/index" serve.port="$PORT" > "$RUN/retriever.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
python - "$PORT" <<'PY'
import sys, time, httpx
for _ in range(240):
    try:
        if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1).json()["status"] == "ok":
            break
    except (httpx.HTTPError, ValueError):
        time.sleep(0.5)
else:
    sys.exit("the retriever did not start; see its log")
PY
QUESTION=$(python -c 'import json, sys; print(next(q for q in map(json.loads, open(sys.argv[1])) if q["source"] == "toy_both")["question"])' "$RUN/toy/questions/test.jsonl")
echo "question: $QUESTION"
etagent tool search --query "$QUESTION" tools.search.local.url="http://127.0.0.1:$PORT"
echo 'print(2091 - 1831)' | etagent tool python
kill $SERVER

echo
echo "demo finished: outputs in $RUN"
