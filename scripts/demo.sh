#!/usr/bin/env bash
# The main job on the embedded default: every stage of the pipeline on the toy world, on CPU.
#   bash scripts/demo.sh [RUN_DIR]      (default runs/demo; rerunning resumes where it stopped)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ETAGENT_VENV:-.venv}
RUN=${1:-runs/demo}
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false

echo "== 1/4 toy world and tiny model -> $RUN/toy"
etagent toy build --out "$RUN/toy"

echo
echo "== 2/4 retriever index over the toy corpus -> $RUN/index"
python -m retriever.build corpus="$RUN/toy/corpus.jsonl" index_dir="$RUN/index"

echo
echo "== 3/4 SFT of the tiny model on the seed trajectories, tool results masked -> $RUN/sft (a few minutes)"
python -m sft.run model="$RUN/toy/model" data.path="$RUN/toy/sft.jsonl" out_dir="$RUN/sft" train.progress_bar=false

echo
echo "== 4/4 rollouts of the SFT policy on the held-out questions, with the real tools -> $RUN/sample"
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
etagent sample engine.model="$RUN/sft/model" questions="$RUN/toy/questions/test.jsonl" out_dir="$RUN/sample" n=2 \
  tools.search.local.url="http://127.0.0.1:$PORT"
kill $SERVER
python - "$RUN/sample/trajectories.jsonl" <<'PY'
import json, sys
from etagent import protocol
groups = [json.loads(line) for line in open(sys.argv[1])]
rollouts = [t for g in groups for t in g["trajectories"]]
valid = sum(protocol.validate_format(t["text"]) for t in rollouts) / len(rollouts)
print(f"{len(rollouts)} rollouts: {valid:.1%} follow the protocol's format, {sum(len(t['tool_calls']) for t in rollouts) / len(rollouts):.2f} tool calls each")
example = next(g for g in groups if g["source"] == "toy_both")
print(f"example (question: {example['question']}; gold: {example['answer'][0]}):")
print("    " + example["trajectories"][0]["text"].replace("\n", "\n    "))
PY

echo
echo "demo finished: outputs in $RUN"
