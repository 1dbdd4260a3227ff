# Two commands set everything up on a fresh machine:
#   make demo   # builds .venv, installs mergekit-ram, runs the demo merge (no download)
#   make test   # same install, runs the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The install pins torch for this environment only (the package itself accepts torch>=2.2):
# torch 2.13.0 resolves to the local CPU wheel here. Elsewhere: make demo TORCH=torch
TORCH ?= torch==2.13.0
DEMO_DIR ?= out/demo
# mergekit: `make install` takes the oldest release the package supports (the lower bound of its range in
# pyproject.toml), `make test-mergekit-newest` the newest that range lets pip install, in its own environment.
MERGEKIT_OLDEST ?= 0.1.5
NEWEST_VENV ?= .venv-mergekit-newest
# The tests that mergekit-ram plugs into that mergekit: its internals, the entry points, a moved mergekit,
# the exact merges and other methods unchanged.
DROP_IN_TESTS ?= tests/test_internals.py tests/test_entry_points.py tests/test_moved_mergekit.py \
	tests/test_merge_exact.py tests/test_reliability.py::test_other_methods_are_unchanged_by_the_plugin
# pytest-xdist workers for `make test`; each runs whole test files, so a module fixture is built once, the
# longest files first (tests/conftest.py: SLOWEST_FIRST).
TEST_WORKERS ?= 2
# The benchmarks' own end-to-end check (the agents experiment at toy size): `make test-benchmarks`, run by CI,
# not by `make test`, which checks the product.
BENCHMARK_TESTS ?= tests/test_agents_smoke.py

.PHONY: install demo test test-benchmarks test-mergekit-newest lint release-check bench quality clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml hatch_build.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH)" "mergekit==$(MERGEKIT_OLDEST)" -e ".[dev,plot,bench]"
	touch $@

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/mergekit-ram demo $(DEMO_DIR)

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --ignore=$(BENCHMARK_TESTS)

test-benchmarks: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(BENCHMARK_TESTS)

# pip upgrades mergekit to the newest release pyproject.toml's range allows (the same as the oldest
# while no newer one is out), then the drop-in tests run against it.
test-mergekit-newest:
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/pip install --quiet --disable-pip-version-check --upgrade "$(TORCH)" mergekit -e ".[dev]"
	$(NEWEST_VENV)/bin/python -c 'import importlib.metadata as m; print("mergekit", m.version("mergekit"))'
	HF_HUB_OFFLINE=1 $(NEWEST_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(DROP_IN_TESTS)

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

# Build the sdist and the wheel, twine check them, compare their contents with
# tests/release_contents.txt, install the wheel into a fresh environment and run the demo there
# (docs/contributing.md). Downloads the dependencies, with the same torch as the install above.
release-check: install
	HF_HUB_OFFLINE=1 $(BIN)/python tests/release_check.py --torch "$(TORCH)"

# Performance (docs/performance.md) and merge quality (docs/quality.md); long, best on a quiet machine.
# `make bench LOAD=4`: the methods again beside 4 busy background processes (ended by their ids afterwards).
LOAD ?= 0
bench: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.run --size 120m --repeats 3 --load $(LOAD)

quality: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks.agents.run --out benchmarks/agents/results --doc docs/quality.md

clean:
	rm -rf $(VENV) $(NEWEST_VENV) out dist .pytest_cache
