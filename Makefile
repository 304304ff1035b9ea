# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/local.yaml

.PHONY: install run lint test test-unit test-e2e plan clean

$(BIN)/.installed: pyproject.toml constraints/cpu.txt constraints/common.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]" -c constraints/cpu.txt
	touch $@

install: $(BIN)/.installed

run: install
	$(BIN)/miles run $(CONFIG)

plan: install
	$(BIN)/miles plan $(CONFIG)

lint: install
	$(BIN)/ruff check .

# Serial: two pytest-xdist workers took 30:58 against 43:23, but their second run failed on two
# machine-wide races between the workers, a Prefect port taken between its pick and its bind and
# a Ray init that joined the other worker's cluster (docs/benchmarks/test_suite_cpu_2026-12-07.md).
test: install
	$(BIN)/pytest tests --ignore=tests/gpu --basetemp=.pytest-tmp --durations=25

test-unit: install
	$(BIN)/pytest tests/unit

clean:
	rm -rf .miles
