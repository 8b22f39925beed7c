# Two commands matter: `make demo` and `make test`. Each sets up what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
FAKENVML_DIR := tests/fakenvml
FAKENVML := $(FAKENVML_DIR)/build/libnvidia-ml.so.1
DSTATE := $(FAKENVML_DIR)/build/dstate

.PHONY: all test test-gpu lint typecheck unit demo bench fakenvml clean venv mutate mutate-changed explore catalog

all: test

# Set-up is quiet: pip's and the build backend's output go to $(VENV)/setup.log, shown only
# when the set-up fails.
$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
		{ echo "gpuwatchd needs Python >= 3.10 (set PYTHON=...)" >&2; exit 1; }
	@echo "Setting up $(VENV) (pip's output: $(VENV)/setup.log)"
	@$(PYTHON) -m venv $(VENV)
	@{ $(PY) -m pip install --quiet --upgrade pip && \
		$(PY) -m pip install --quiet -e '.[test]'; } >$(VENV)/setup.log 2>&1 || \
		{ cat $(VENV)/setup.log >&2; echo "set-up failed (log: $(VENV)/setup.log)" >&2; exit 1; }
	@touch $@

venv: $(VENV)/.installed

$(FAKENVML): $(FAKENVML_DIR)/fakenvml.c
	@echo "Building the fake NVML library ($@)"
	@mkdir -p $(FAKENVML_DIR)/build
	@$${CC:-cc} -std=c11 -O2 -Wall -Wextra -Werror -shared -fPIC \
		-Wl,-soname,libnvidia-ml.so.1 -o $@ $< -lpthread

$(DSTATE): tests/support/dstate.c
	@mkdir -p $(FAKENVML_DIR)/build
	@$${CC:-cc} -std=c11 -O2 -Wall -Wextra -Werror -o $@ $<

fakenvml: $(FAKENVML) $(DSTATE)

lint: venv
	$(VENV)/bin/ruff check gpuwatchd tests bench
	$(VENV)/bin/ruff format --check gpuwatchd tests bench

typecheck: venv
	$(VENV)/bin/mypy

# pytest over every core (pytest-xdist; tests/conftest.py keeps the tests that share a
# module's fixture, a container say, on one worker), three workers a core: most of a system
# test's time is spent waiting (a daemon's polls, a container's boot), which a third worker
# per core fills (make test on 2 cores: 6 min 26 s with two a core, 5 min 27 s with three,
# one after the other). PYTEST_WORKERS=0 runs them in one process.
PYTEST_WORKERS ?= $(shell echo $$(( $$(nproc) * 3 )))
# Compiled code is kept in build/pycache, also where PYTHONDONTWRITEBYTECODE is set: otherwise
# every worker, and every `python -m gpuwatchd`, daemon or PID-namespace child a test starts,
# compiles the package again and pytest rewrites the tests again (about 40 % of the CPU of a test
# that runs the command line). A collection pass fills it first, so that the workers read it
# instead of each compiling everything at once; its errors show in the run that follows.
BYTECODE := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(CURDIR)/build/pycache
unit: venv fakenvml
	@$(BYTECODE) $(PY) -m pytest --collect-only -q -p no:cacheprovider >/dev/null 2>&1 || true
	$(BYTECODE) $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup

# The three at once; each one's output is shown whole when it ends, and any failure fails it.
test: venv fakenvml
	@$(MAKE) --no-print-directory -j3 --output-sync=target lint typecheck unit

# On a real GPU machine: the read-only `gpu`-marked tests (they skip visibly elsewhere).
test-gpu: venv
	$(PY) -m pytest -m gpu -rs -v tests/system/test_gpu.py

# Mutation testing of decide/'s safety gates (docs/architecture.md, "Mutation testing"): the
# score per module and every survivor that is not a recorded equivalent; fails on one in a
# critical function, or on a critical mutant the time limit left unrun. About 10,000 mutants,
# 30 minutes on 2 cores. MODULES="floor plan" mutates only those. It records
# tests/mutation/fingerprints.json.
MODULES ?=
MUTATE_FULL_TIME_LIMIT ?= 14400
mutate: venv fakenvml
	$(PY) -m tests.mutation --record --time-limit $(MUTATE_FULL_TIME_LIMIT) $(MODULES)

# What CI runs: only the functions whose fingerprint (the function with what it calls, the tables
# and policy defaults it reads) differs from tests/mutation/fingerprints.json, time-boxed;
# critical mutants left unrun fail it.
MUTATE_TIME_LIMIT ?= 1200
mutate-changed: venv fakenvml
	$(PY) -m tests.mutation --changed --time-limit $(MUTATE_TIME_LIMIT)

# The property and state-machine tests, random and long (make test runs them derandomized).
explore: venv
	GPUWATCHD_HYPOTHESIS_PROFILE=explore $(PY) -m pytest -p no:cacheprovider \
		tests/unit/test_plan_stateful.py tests/unit/test_assess.py tests/unit/test_plan.py \
		tests/integration/test_status.py tests/integration/test_config_hostile.py \
		tests/unit/test_fuzz_inputs.py

demo: venv fakenvml
	@$(PY) -m tests.support.demo

bench: venv fakenvml
	$(PY) bench/run.py

# The journal message catalogue (journalctl -x), generated from the event catalogue; the .deb
# installs it in /usr/lib/systemd/catalog/ (packaging/debian/rules).
catalog: venv
	PYTHONPATH=. $(PY) packaging/journal_catalog.py build/gpuwatchd.catalog

clean:
	rm -rf $(VENV) $(FAKENVML_DIR)/build .mypy_cache .ruff_cache .pytest_cache .hypothesis \
		build/mutation build/pycache
