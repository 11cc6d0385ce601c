#!/usr/bin/env bash
# Run the test suite (the README's test command calls this through `make test`).
#   bash scripts/test.sh              # default suite: everything not marked slow
#   bash scripts/test.sh -m slow      # pytest arguments pass through
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${ETAGENT_VENV:-.venv}
# One torch thread per process: tests start servers and subprocesses beside each other on 2 cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline
if [ $# -eq 0 ]; then set -- -m "not slow"; fi
"$VENV/bin/python" -m pytest "$@"
status=$?
if [ $status -eq 5 ]; then
  echo "test.sh: pytest collected no tests for: $*" >&2
fi
exit $status
