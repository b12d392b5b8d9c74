# Everything creates its own virtual environment: on a fresh machine `make demo` / `make test` suffice.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# parallel test processes: most tests wait on real daemons and CLI processes, not on the CPU
# (on 2 cores: 4 took 205 s where 3 took 234 s; the tests marked heavy start first)
TEST_JOBS ?= 4

.PHONY: demo test typecheck bench install bytecode clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Write the .pyc files explicitly: with PYTHONDONTWRITEBYTECODE set (as on some CI images) an
# editable install never caches bytecode, and every `handoff` start would recompile about sixty
# modules (~150 ms). Cheap when nothing changed: compileall only compares timestamps.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q handoffd

demo: bytecode
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh

# mypy runs beside the suite (most tests wait on processes, not on the CPU); either failing
# fails the target.
test: bytecode
	( $(BIN)/mypy handoffd > $(VENV)/mypy.log 2>&1; echo $$? > $(VENV)/mypy.rc ) & \
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q -n $(TEST_JOBS); \
	  rc=$$?; wait; echo "mypy handoffd:"; cat $(VENV)/mypy.log; \
	  test "$$(cat $(VENV)/mypy.rc)" = 0 && exit $$rc || exit 1

# mypy at its default level over the whole package (no blanket ignores); part of `make test`
typecheck: $(STAMP)
	$(BIN)/mypy handoffd

bench: bytecode
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache
