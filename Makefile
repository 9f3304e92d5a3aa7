# Two commands on a fresh machine with Python 3.11+: `make demo` and `make test`.
#
#   make check    the fast loop, under 90 s: lint, types, import contracts, then the unit
#                 and contract tests on SQLite (no PostgreSQL case, no end-to-end process)
#   make unit     every test but the end-to-end suite (unit, contract, integration,
#                 sandbox; PostgreSQL included): the tests marked e2e left out
#   make test     everything: lint, types, import contracts and every test (e2e and the
#                 fault suite included; four workers, then the exclusive tests one at a
#                 time: about 16 minutes with one of two cores kept busy)
#   make lint | typecheck | imports   one check each
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Worker processes for the suite. It waits far more than it computes (partners paced at a
# few requests a second, processes started and stopped), so it runs more workers than cores.
TEST_WORKERS ?= 4

.PHONY: demo scale-demo check test lint typecheck imports unit bench clean

$(STAMP): pyproject.toml sandbox/pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,celery]' -e ./sandbox
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/cleanup-supervisor demo

# Three replicas on this machine's PostgreSQL ($$CLEANUP_DATABASE_URL, else
# postgres@127.0.0.1:5432), one shared rate budget: packaging/compose.yaml without containers.
scale-demo: $(STAMP)
	$(BIN)/cleanup-supervisor demo --shape scale --recipients 3000 --rate 100

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy --strict supervisor sandbox/cleanup_sandbox

# The layering contracts of [tool.importlinter] in pyproject.toml.
imports: $(STAMP)
	$(BIN)/lint-imports --no-cache

check: lint typecheck imports
	$(BIN)/pytest tests/unit tests/contract -q -m "not postgres"

unit: $(STAMP)
	$(BIN)/pytest tests -q -n $(TEST_WORKERS) -m "not e2e"

test: lint typecheck imports
	$(BIN)/pytest tests -q -n $(TEST_WORKERS) -m "not exclusive"
	$(BIN)/pytest tests -q -m exclusive

# Not part of `test`: about 73 minutes (8 partner cells x 4 scenarios x 3 runs each, the
# oracle of each cell the first time, peers on 2 cells, growth; BENCH_ARGS=--repeat 1: 29);
# bench/infrai.py (17 min) and bench/history.py (1 min) run on their own;
# the Celery peer needs Redis on 127.0.0.1:6379.
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(BIN)/python bench/run.py $(BENCH_ARGS)
	$(BIN)/python bench/batch.py

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache .hypothesis
