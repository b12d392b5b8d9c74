# Everything creates its own virtual environment: on a fresh machine `make demo` / `make test` suffice.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# parallel test processes: most tests wait on real daemons and CLI processes, not on the CPU
TEST_JOBS ?= 3

.PHONY: demo test typecheck bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh

test: $(STAMP) typecheck
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -n $(TEST_JOBS)

# mypy at its default level over the whole package (no blanket ignores); part of `make test`
typecheck: $(STAMP)
	$(BIN)/mypy handoffd

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
