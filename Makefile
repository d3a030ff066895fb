# One command installs and starts the default fleet (`make up`); one runs the tests (`make test`).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install up test test-slow bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(VENV)/bin/infera up $(ARGS)

test: $(STAMP)
	$(VENV)/bin/pytest $(ARGS)

test-slow: $(STAMP)
	$(VENV)/bin/pytest -m slow $(ARGS)

# `make bench [BENCH=overhead|trace_replay|indexer|pd] [ARGS=...]`: installs the `bench` extra too
# (sglang-router, for trace_replay's comparison row), then runs bench/$(BENCH).py.
BENCH       ?= overhead
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) bench/$(BENCH).py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
