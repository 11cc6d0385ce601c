#!/usr/bin/env bash
# Resolve the documented GPU install without installing anything (pip's resolver, dry run), so
# that the pins in constraints/gpu.txt and the extras in pyproject.toml can be checked from any
# Linux x86-64 machine, a CPU one included: it prints what a CUDA machine would install (torch,
# vLLM, DeepSpeed, transformers) or pip's conflict. Downloads package metadata (and, where an
# index gives none, whole wheels: a few GB), installs nothing.
#
#   bash scripts/check_gpu_install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$work/venv/bin/python" -m pip install --disable-pip-version-check --dry-run --ignore-installed --quiet \
  --report "$work/report.json" -c constraints/gpu.txt -e ".[gpu,all]"
"$work/venv/bin/python" - "$work/report.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
versions = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]}
print(f"check_gpu_install: the GPU install resolves to {len(versions)} packages, among them:")
for name in ("torch", "vllm", "deepspeed", "transformers", "flashinfer-python", "faiss-cpu", "triton", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12"):
    if name in versions:
        print(f"  {name}=={versions[name]}")
cuda12 = sorted(n for n in versions if n.endswith("-cu12"))
print("  CUDA 12 packages beside torch's: " + (", ".join(cuda12) if cuda12 else "none"))
PY
