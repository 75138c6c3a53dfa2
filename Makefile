# Every target creates .venv on first use and reinstalls only when pyproject.toml or the
# constraints change. Nothing else needs to be set up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The plugins lane's own venv: pytest-randomly and pytest-rerunfailures act in every session
# that loads them, so they stay out of .venv (where other lanes' inner sessions would load them).
PLUGINS_VENV := .venv-plugins
PLUGINS_STAMP := $(PLUGINS_VENV)/.installed-stamp
PYTEST_WORKERS ?= 2

.PHONY: demo test lint typecheck unit unit-fast test-slow test-faults test-isolation test-neighbour test-plugins test-cluster test-versions test-loaded test-deepspeed bench gpu clean

$(STAMP): pyproject.toml ci/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c ci/constraints.txt -e '.[test,dev,bench]'
	touch $@

$(PLUGINS_STAMP): pyproject.toml ci/constraints.txt
	test -x $(PLUGINS_VENV)/bin/python || $(PYTHON) -m venv $(PLUGINS_VENV)
	$(PLUGINS_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c ci/constraints.txt -e '.[test,plugins]'
	touch $@

demo: $(STAMP)
	$(PY) examples/run_demo.py

test: lint typecheck unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m "not slow and not gpu and not isolation and not neighbour and not plugins and not deepspeed and not cluster" -ra

# Logic tested directly in this process, with fakes (marker `unit`: a test so marked that
# starts a process fails): under half a minute on 2 cores, for a quick loop while editing.
unit-fast: $(STAMP)
	$(PY) -m pytest -p no:xdist -q -m unit tests

# Whole-process checks (pytest sessions in subprocesses: kills, Ctrl-C, start methods,
# torchrun launches, adopted suites) and the failure matrix: 15 min on 2 cores (measured
# 2026-12-03, load ~2; 25 min at load 10). CI runs it after test.
test-slow: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m "slow and not gpu and not isolation and not neighbour and not plugins and not deepspeed and not cluster" -ra

# The failure matrix at 2, 4 and 8 ranks (slow: minutes); also selected by -m slow.
test-faults: $(STAMP)
	$(PY) -m pytest -m slow tests/harness/test_fault_matrix.py -ra -v

# Pairs of tests on the same warm ranks: the first leaves process state behind, the second
# must not see it: 1.5 min on 2 cores, load ~2 (3.7 min on a busy runner). CI runs it after
# test-slow.
test-isolation: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m isolation -ra

# Plain tests probing the process state they see (their own, their children's of every
# start method): identical without the plugin, with it, beside ranks tests, after a ranks
# session and under --rank-adopt. Each a fresh pytest session: 1-2 min.
test-neighbour: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m neighbour -ra

# make test's selection on the declared floors of torch and pytest and on the newest torch
# PyPI serves (its CUDA build, on this GPU-less machine), each in a venv of its own under
# .venv-versions/: about 30 min, so not in .ci/run; the last matrix is in docs/versions.md.
test-versions:
	bash ci/versions

# The plugins CI runs (pytest-cov and coverage run, pytest-randomly, hypothesis,
# pytest-rerunfailures, pytest-repeat) against ranks tests at 2 and 4 ranks, warm and fresh:
# each a whole session in a subprocess: 2-3 min on 2 cores. CI runs it after test-isolation.
test-plugins: $(PLUGINS_STAMP)
	$(PLUGINS_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) -m plugins -ra

# A cluster built on this machine (network namespaces as nodes, Debian's SLURM, munge,
# torchrun's c10d rendezvous across them; ci/cluster builds it and tears it down however the
# run ends) and the tests that launch across it and lose nodes (marker `cluster`). Needs
# root; skipped, saying why, where namespaces or the packages cannot be had. CI runs it.
test-cluster: $(STAMP)
	bash ci/cluster

# make test's tests, the demo's tests and the failure matrix under 4 CPU burners per core:
# the same verdicts as on a quiet machine (24.5 min on 2 cores, measured 2026-12-03; not in
# .ci/run).
test-loaded: $(STAMP)
	bash ci/loaded

# DeepSpeed's own unit tests from a checkout, adopted (DEEPSPEED_SRC=DIR; without it the
# lane says so and passes): its own venv, .venv-deepspeed (see ci/deepspeed). Not in .ci/run:
# CI has no DeepSpeed checkout.
test-deepspeed:
	bash ci/deepspeed

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

gpu:
	bash ci/gpu

clean:
	rm -rf $(VENV) $(PLUGINS_VENV) .venv-deepspeed .mypy_cache .ruff_cache .pytest_cache
