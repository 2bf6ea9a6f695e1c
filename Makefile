# Two ways in: `make demo` (set up, then run the pipeline on SmolLM2-135M offline) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# The locks (requirements/cpu.txt, requirements/gpu.txt) pin every package; `make lock` refreshes them from
# pyproject.toml and requirements/{overrides,cpu-constraints,gpu-constraints}.txt. PyTorch's CPU build comes from a
# find-links source: pip's own where it has one (this project's machines), else PyTorch's CPU index.
TORCH_CPU_WHEELS ?= $(or $(PIP_FIND_LINKS),https://download.pytorch.org/whl/cpu/torch/)
UV      ?= $(if $(wildcard $(BIN)/uv),$(BIN)/uv,uv)
COMPILE = $(UV) pip compile pyproject.toml --quiet --override requirements/overrides.txt --custom-compile-command "make lock"
CPU_LOCK = $(COMPILE) --extra test --extra demo -c requirements/cpu-constraints.txt --find-links $(TORCH_CPU_WHEELS) \
           --python-version 3.11 --python-platform x86_64-manylinux_2_28
# A GPU host's wheel tags and the packages the registry has as sources only: benchmarks/gpu/lock_kit.py holds them,
# for the device's install too.
GPU_HOST_FLAGS = $(BIN)/python benchmarks/gpu/lock_kit.py pip-flags
GPU_LOCK = $(COMPILE) --extra gpu -c requirements/gpu-constraints.txt --python-version 3.12 --python-platform x86_64-manylinux_2_31

.PHONY: setup demo test gpu-test lock lock-check
setup: $(VENV)/.installed
# Exactly the lock, nothing resolved on the day: --no-deps everywhere (the lock already holds every dependency).
$(VENV)/.installed: requirements/cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "pip==26.3"  # the installer that made the lock's environments
	$(BIN)/pip install -q --no-deps -r requirements/cpu.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

demo: setup
	$(BIN)/quantgate demo

test: setup
	$(BIN)/python -m pytest -q

# Refresh both locks: the pins already there are kept where they still fit (uv prefers an output file's pins);
# `make lock UPGRADE=--upgrade` takes the newest releases that fit pyproject.toml and the constraints.
lock:
	$(CPU_LOCK) $(UPGRADE) -o requirements/cpu.txt
	$(GPU_LOCK) $(UPGRADE) -o requirements/gpu.txt

# CI: the locks still resolve from pyproject.toml as committed (a dependency edited without `make lock`, or a pin
# gone from the registry, fails here), and every pin of the GPU lock has a wheel for a Python 3.12 x86-64 host.
lock-check: setup
	@d=$$(mktemp -d) && cp requirements/cpu.txt requirements/gpu.txt $$d/ && \
	$(CPU_LOCK) -o $$d/cpu.txt && $(GPU_LOCK) -o $$d/gpu.txt && \
	diff -u requirements/cpu.txt $$d/cpu.txt && diff -u requirements/gpu.txt $$d/gpu.txt && \
	host=$$($(GPU_HOST_FLAGS)) && \
	$(BIN)/pip install -q --dry-run --ignore-installed --no-deps --only-binary=:all: $$host --target $$d/site \
	    -r requirements/gpu.txt && rm -rf $$d && echo "lock-check: both locks resolve as committed"

gpu-test:
	bash benchmarks/gpu/run_tests.sh
