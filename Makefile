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

# Two pytest workers, a test file at a time each: one process alone left about a quarter of the
# 2 cores idle (Ray and servers starting, processes importing). OpenMP threads wait passively:
# libgomp's spinning waits took the other worker's cores (docs/benchmarks/test_suite_cpu_*.md).
test: install
	OMP_WAIT_POLICY=PASSIVE $(BIN)/pytest tests --ignore=tests/gpu -n 2 --dist loadfile --basetemp=.pytest-tmp --durations=25

test-unit: install
	$(BIN)/pytest tests/unit

clean:
	rm -rf .miles
