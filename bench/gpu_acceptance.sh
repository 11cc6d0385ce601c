#!/usr/bin/env bash
# The GPU acceptance of the paper presets, on one CUDA GPU (about 7 minutes on an H200: sft 1, rl 3.5, memory 2.5).
# Prints PASS or FAIL for each item it ran and NOT RUN, with the reason, for what the machine
# lacks (no CUDA GPU, vLLM or DeepSpeed not installed); never a pass it did not see.
#
#   bash bench/gpu_acceptance.sh [WORK_DIR]            # default: a fresh temporary folder
#   bash bench/gpu_acceptance.sh --smoke [WORK_DIR]    # toy sizes on any device: checks the script
#   ITEMS="rl-lora hf-engine" bash bench/gpu_acceptance.sh # only these items
#
# Needs the toolkit importable (pip install -e . on the machine's own torch; the GPU extra and
# flash-attention are optional and reported). The items (bench/gpu_acceptance.py says more):
#   sft              the SFT paper preset on a random-init Qwen2.5-0.5B-shaped model, 40 steps
#   rl               the RL paper preset, hf engine under FSDP2, 2 steps, then a resumed third
#   rl-vllm          the same with the colocated vLLM engine and its streamed weight sync
#   rl-partial       the RL paper preset with partial rollouts (hf engine), Qwen2.5-0.5B shape, 2 steps + a resume
#   rl-lora          configs/rl/paper_1gpu.yaml (LoRA, hf engine), Qwen2.5-7B's widths and depth, 2 steps + a resume
#   hf-engine        the hf engine's continuous batching against transformers' generate (bench_hf_engine.py)
#   memory-update    the peak of one update on a 7B-wide slice against bench/memory_plan.py
#   memory-logprobs  the peak of the chunked log-probabilities at 8192 tokens x 152,064
#   throughput       the update's tokens/s and MFU on the same slice
# Exits 1 when an item failed, 0 otherwise (NOT RUN items included).
set -uo pipefail
cd "$(dirname "$0")/.."
smoke=()
if [ "${1:-}" = "--smoke" ]; then smoke=(--smoke); shift; fi
work=${1:-$(mktemp -d)}
mkdir -p "$work"
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 WANDB_MODE=offline
started=$(date +%s)
results="$work/results.txt"
: > "$results"

echo "gpu_acceptance: work in $work"
"$PYTHON" - <<'PY'
import torch, transformers
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA GPU"
print(f"gpu_acceptance: torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, {gpu}")
PY

if [ ! -f "$work/toy/sft.jsonl" ]; then
  "$PYTHON" -m etagent.toy.build --out "$work/toy" > "$work/toy.log" 2>&1 || { echo "gpu_acceptance: the toy world did not build (see $work/toy.log)"; exit 1; }
fi
on_gpu=$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))')

for item in ${ITEMS:-sft rl rl-vllm rl-partial rl-lora hf-engine memory}; do
  if [ "$on_gpu" = 0 ] && [ ${#smoke[@]} -eq 0 ]; then
    echo "RESULT $item NOT RUN no CUDA GPU (--smoke checks the script on CPU)" | tee -a "$results"
    continue
  fi
  if [ ${#smoke[@]} -gt 0 ] && { [ "$item" = memory ] || [ "$item" = hf-engine ]; } && [ "$on_gpu" = 0 ]; then
    echo "RESULT $item NOT RUN no CUDA GPU" | tee -a "$results"
    continue
  fi
  "$PYTHON" bench/gpu_acceptance.py "$item" --work "$work" "${smoke[@]}" 2>&1 | tee "$work/$item.out" | grep '^RESULT' | tee -a "$results"
  grep -q '^RESULT' "$work/$item.out" || echo "RESULT $item FAIL no result (see $work/$item.out)" | tee -a "$results"
done

echo
echo "gpu_acceptance: $(( $(date +%s) - started )) s"
sed 's/^RESULT /  /' "$results"
! grep -q '^RESULT [a-z-]* FAIL' "$results"
