# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed
LINT_PATHS := src tests $(wildcard benchmarks/*.py examples/*.py)

.PHONY: demo test lint unit distributed cli bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/trainguard demo

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy

# Two tests at a time (CI has 2 cores; many tests wait on processes, sleeps and timeouts);
# TEST_WORKERS=0 runs them one by one.
TEST_WORKERS ?= 2

# The tests start hundreds of Python processes that import trainguard: its bytecode is
# written once here (compileall writes it even where PYTHONDONTWRITEBYTECODE is set, as on
# CI's image, where each process compiled the package again: ~0.2 s of CPU each).
test: lint
	$(BIN)/python -m compileall -q src tests > /dev/null
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
