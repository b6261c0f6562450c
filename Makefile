# The README's commands. Every target goes through the same idempotent bootstrap.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: env test lint unit integration demo bench clean

env:
	@bash scripts/bootstrap.sh

lint: env
	$(PY) -m ruff check splitserve tests benchmarks examples
	$(PY) -m ruff format --check splitserve tests benchmarks examples

unit: env
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

integration: env
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

test: lint
	$(PY) -m pytest tests $(PYTEST_ARGS)

demo: env
	$(PY) -m splitserve.cli demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache runs
