# Two commands for a fresh machine (see README.md):
#   make demo    set up .venv and run the pipeline on the toy world (CPU)
#   make test    set up .venv and run the tests (CPU)

.PHONY: demo test test-all setup

setup:
	bash scripts/setup.sh

# The demo needs neither the test tools nor vLLM's CPU build (517 MB): the toy runs on the hf engine.
demo:
	ETAGENT_EXTRAS=all bash scripts/setup.sh
	bash scripts/demo.sh

test: setup
	bash scripts/test.sh

# Also the tests marked slow.
test-all: setup
	bash scripts/test.sh -m ""
