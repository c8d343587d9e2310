# fedpipe developer commands. Each target creates .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of PyTorch. On a GPU machine install the CUDA build instead, see README.
TORCH  ?= torch==2.13.0

.PHONY: demo test test-fast lint lint-fast bench protos clean venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,demo]"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/fedpipe demo --nodes 3

# Everything: lint and types, then every test, those that start processes included
# (a LocalSwarm, fedpipe commands, a browser, network namespaces; several minutes).
# Two workers, a test file each at a time (--dist loadfile: a module's fixtures stay in one
# process): most of a multi-process test's time is waiting (leases, links, steps), so two
# run in 16 min on 2 cores what one runs in 28.
test: lint
	sh tools/setup-test-deps.sh
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The in-process tests only (under a minute): the tests marked `processes` are left out,
# and tests/conftest.py fails any unmarked test that starts a process.
test-fast: lint-fast
	$(PY) -m pytest -q -m "not processes" tests

lint: lint-fast
	$(PY) -m mypy

lint-fast: $(VENV)/.installed
	$(PY) -m ruff check fedpipe tests benchmarks tools

bench: $(VENV)/.installed
	$(PY) benchmarks/wire.py
	$(PY) benchmarks/planner.py
	$(PY) benchmarks/emulated.py
	$(PY) benchmarks/async.py
	$(PY) benchmarks/faults.py

protos: $(VENV)/.installed
	$(PY) tools/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info
