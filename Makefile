# Two set-up commands: `make demo` and `make test`. Both bootstrap .venv from nothing and are quick
# when it is already there (the stamp file is rebuilt only when pyproject.toml changes).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvresume-installed
PYTEST_ARGS ?=

.PHONY: demo test test-all lint bench venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, and only when none is importable: the CPU build on this disk, never a multi-GB CUDA pull.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[server,dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Test processes (pytest-xdist): the CI machine's 2 cores; TEST_WORKERS=0 runs the suite in one process.
# loadgroup: tests marked xdist_group(name) are meant to run on one worker, so they can share a module
# fixture. Under pytest 9.2 with pytest-xdist 3.8.0 the grouping does nothing (xdist tags the group onto
# `item._nodeid`, which pytest 9 no longer reads): grouped tests spread over the workers like the rest.
TEST_WORKERS ?= 2

# Byte-compiled once before the run: where PYTHONDONTWRITEBYTECODE is set (these machines set it), every
# process the tests start (about 100 model processes, `kvresume serve`, the CLI) compiled the project's
# modules from source again.
PROJECT_PACKAGES := orchestrator model kernels mappers storage proto kvresume benchmarks tests

# --durations: the slowest tests in every CI log, where the suite's 10-minute limit is watched (the same
# suite took 366-492 s on the 2-core VMs as their speed drifted)
test: lint
	$(PY) -m compileall -q -j 0 $(PROJECT_PACKAGES)
	$(PY) -m pytest -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadgroup --durations=15 $(PYTEST_ARGS)

test-all: lint
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/kvresume demo
