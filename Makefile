# Two commands: `make run` (set up + start a one-node mesh) and `make test` (set up + lint + tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?= smollm2-135m
ARGS ?=

.PHONY: run test setup lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/mesh models pull $(MODEL)
	$(BIN)/mesh up --model $(MODEL) $(ARGS)

lint: setup
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/python -m pytest -q $(ARGS)

bench: setup
	$(BIN)/python bench/worker_vs_mlx_lm.py
	$(BIN)/python bench/gateway_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
