# gpuguard: every target installs what it needs. See README.md.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install run test unit lint fakenvml testenv kube-up kube-down bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# The demo: 8 mock GPUs, dry run, no GPU and no cluster needed; healthy, then a fault, then the change it
# would make to the node. Stops by itself after 8 s.
run: install
	$(BIN)/gpuguard watch --dry-run --backend mock --interval 0.5 --run-for 8 --listen 127.0.0.1:0 --log-format console

# The fake libnvidia-ml.so.1 (tests/fakenvml), built with the machine's gcc; the real nvml backend runs on it.
fakenvml:
	tests/fakenvml/build.sh build/fakenvml

test: install fakenvml
	$(BIN)/python -m pytest -q

unit: install fakenvml
	$(BIN)/python -m pytest -q --ignore=tests/integration

# Every performance figure in docs/performance.md comes from here.
bench: install fakenvml
	$(BIN)/python bench/run.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/hadolint Dockerfile

clean:
	rm -rf build .kube-test .pytest_cache .mypy_cache .ruff_cache
