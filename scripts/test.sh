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
# Headless Chromium for the report's browser tests (tests/test_report.py): Debian's package, where
# this runs as root with apt-get; elsewhere those tests are skipped, saying why.
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "test.sh: installing Debian's chromium for the report's browser tests"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -q --no-install-recommends chromium || { apt-get update -q && apt-get install -y -q --no-install-recommends chromium; }; } >/dev/null 2>&1 ||
    echo "test.sh: could not install chromium; the report's browser tests will be skipped" >&2
fi
# The default run on two workers (pytest-xdist), beside the shared toy policy's SFT, which trains
# in the background from the start (tests/conftest.py).
if [ $# -eq 0 ]; then set -- -m "not slow" -n 2; fi
"$VENV/bin/python" -m pytest "$@"
status=$?
if [ $status -eq 5 ]; then
  echo "test.sh: pytest collected no tests for: $*" >&2
fi
exit $status
