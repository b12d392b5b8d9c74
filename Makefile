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

# pytest rewrites each test module's asserts and caches the result in tests/__pycache__, but
# not with PYTHONDONTWRITEBYTECODE set: then each of the TEST_JOBS workers rewrote every module
# again (about 10 s of CPU each, 2.6 s from the cache). So two collections with the variable
# unset (one per half of the files, side by side) write the cache first.
WARM = env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q --collect-only -p no:cacheprovider

# mypy runs beside the suite (most tests wait on processes, not on the CPU); either failing
# fails the target.
test: bytecode
	( $(BIN)/mypy handoffd > $(VENV)/mypy.log 2>&1; echo $$? > $(VENV)/mypy.rc ) & \
	$(WARM) $$(ls tests/test_*.py | awk 'NR % 2') > /dev/null & \
	$(WARM) $$(ls tests/test_*.py | awk 'NR % 2 == 0') > /dev/null; wait $$!; \
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
