# The two commands of the README. Both set up .venv themselves.
JOB ?= examples/tiny-cpu.yaml
PYTEST_ARGS ?=
# Three pytest workers on 2 cores: with two, the cores were idle 39% of the suite (the e2e tests
# wait on start-ups, restarts and timeouts), and it took 17 min 52 s; with three, 1.5% and
# 15 min 43 s (a 2-core Xeon VM; 25-27 min on 2-core AMD EPYC VMs, 2026-12-05). Each test file
# stays on one worker, so module fixtures are built once.
TEST_WORKERS ?= 3

.PHONY: setup run test lint images test-containers
setup:
	@scripts/setup.sh

run: setup
	.venv/bin/pipelinerl run --pin-cores $(JOB)

test: setup
	@scripts/test-tools.sh
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# Lint, format and type checks (CI runs them before the tests).
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

# The operator and CPU services images, built with buildah on a base made from Debian's packages.
images: setup
	@scripts/images.sh

# The tiny job's rendered pods run as podman containers from those images (CI runs it after `test`).
test-containers: images
	.venv/bin/python -m pytest -m containers tests/containers $(PYTEST_ARGS)
