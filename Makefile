# Two commands: `make run` (set up + start a one-node mesh) and `make test` (set up + lint + tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL ?= smollm2-135m
ARGS ?=

.PHONY: run test unit setup lint browser clients e2e-clients blas bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP) blas

# MLX's Linux CPU wheel ships a reference BLAS (~2-5 GFLOP/s); workers preload Debian's OpenBLAS
# in its place when it is installed (worker/cpu/fast_path.py). Install it when missing and we are root,
# otherwise workers (and the tests) run on the slow one and say so.
blas:
	@if [ "$$(uname -s)" != Linux ] || [ -n "$$(ldconfig -p 2>/dev/null | grep libopenblas)" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenblas0-pthread) \
		|| echo "note: could not install libopenblas0-pthread; the CPU worker will use MLX's slow reference BLAS"; \
	else echo "note: no OpenBLAS and not root; the CPU worker will use MLX's slow reference BLAS"; fi

# LD_PRELOAD for the test run: OpenBLAS first when found (Linux CPU), else what it was.
PRELOAD = $(BIN)/python -c 'from worker.cpu.fast_path import preload_env; print(preload_env().get("LD_PRELOAD", ""))'

run: setup
	$(BIN)/mesh models pull $(MODEL)
	$(BIN)/mesh up --model $(MODEL) $(ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The console's browser tests drive Debian's Chromium: install it when missing and we are root,
# otherwise those tests skip with the reason.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) \
		|| echo "note: could not install chromium; the console browser tests will be skipped"; \
	else echo "note: no /usr/bin/chromium and not root; the console browser tests will be skipped"; fi

# The client end-to-end tests drive real coding agents (Claude Code, Codex CLI, OpenCode) against a
# scripted gateway. Opt-in (`make e2e-clients`), not part of `make test` nor CI: it installs them
# from npm into .cache/clients; without them those tests skip with the reason.
CLIENTS := .cache/clients
CLIENT_PACKAGES := @anthropic-ai/claude-code @openai/codex opencode-ai
clients:
	@if [ -x $(CLIENTS)/node_modules/.bin/claude ] && [ -x $(CLIENTS)/node_modules/.bin/codex ] \
		&& [ -x $(CLIENTS)/node_modules/.bin/opencode ]; then :; \
	elif command -v npm >/dev/null; then \
		npm install -q --no-audit --no-fund --prefix $(CLIENTS) $(CLIENT_PACKAGES) \
		|| echo "note: could not install $(CLIENT_PACKAGES); their tests will be skipped"; \
	else echo "note: no npm; the agent client tests will be skipped"; fi

# The suite runs over TEST_JOBS pytest-xdist workers (auto: one per core), a whole file per worker
# (module-scoped fixtures are built once, a file's tests never race each other); session fixtures
# such as the tiny models are built once per worker, in its own temp dir. The 15 slowest tests are
# listed at the end.
TEST_JOBS ?= auto
test: setup lint browser
	LD_PRELOAD="$$($(PRELOAD))" $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile \
		--durations=15 $(ARGS)

e2e-clients: setup clients
	LD_PRELOAD="$$($(PRELOAD))" $(BIN)/python -m pytest -q tests/e2e/test_codex_cli.py tests/e2e/test_claude_code.py tests/e2e/test_opencode.py $(ARGS)

# The fast loop: unit tests of the pure pieces only (no servers, processes or browser).
unit: setup
	LD_PRELOAD="$$($(PRELOAD))" $(BIN)/python -m pytest -q -m "not e2e" $(ARGS)

bench: setup
	$(BIN)/python bench/worker_vs_mlx_lm.py
	$(BIN)/python bench/gateway_overhead.py
	$(BIN)/python bench/tunnel_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .cache
