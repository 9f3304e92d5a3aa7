# Two commands on a fresh machine with Python 3.11+: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo scale-demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml sandbox/pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]' -e ./sandbox
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

unit: $(STAMP)
	$(BIN)/pytest tests -q

test: lint typecheck unit

# Not part of `test`: about 29 minutes (8 partner cells x 4 runs, peers on 2 cells, growth);
# bench/infrai.py (17 min) and bench/history.py (1 min) run on their own;
# the Celery peer needs Redis on 127.0.0.1:6379.
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(BIN)/python bench/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache .hypothesis
