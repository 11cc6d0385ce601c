# Two commands for a fresh machine (see README.md):
#   make demo    set up .venv and run the pipeline on the toy world (CPU)
#   make test    set up .venv and run the tests (CPU)

.PHONY: demo test test-all setup imports

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

# Every import of the code, tests, scripts and benches resolves under pyright on this install
# (pyproject's [tool.basedpyright]); CI runs it after the tests.
imports: setup
	.venv/bin/basedpyright --pythonpath .venv/bin/python
