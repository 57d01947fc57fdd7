# The two commands of the README. Both set up .venv themselves.
JOB ?= examples/tiny-cpu.yaml
PYTEST_ARGS ?=

.PHONY: setup run test lint
setup:
	@scripts/setup.sh

run: setup
	.venv/bin/pipelinerl run --pin-cores $(JOB)

test: setup
	@scripts/test-tools.sh
	.venv/bin/python -m pytest --durations=25 $(PYTEST_ARGS)

# Lint, format and type checks (CI runs them before the tests).
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
