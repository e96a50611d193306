# The README's commands. `make demo` and `make test` set everything up on a fresh machine.
#   make test                       primary leg: Python 3.12, newest megatron-core (0.19.2)
#   make test PYTHON=python3.11     compatibility leg: megatron-core 0.16.1, torch 2.13.0 (CPU)
PYTHON ?= python3.12
PYVER := $(patsubst python%,%,$(notdir $(PYTHON)))
VENV ?= $(if $(filter 3.12,$(PYVER)),.venv,.venv-$(PYVER))
CONSTRAINTS ?= constraints/py$(PYVER).txt
PYTEST_ARGS ?=

# A plain `python3.12` where it runs; otherwise the one pyenv has installed but not selected.
PYTHON_BIN := $(shell if $(PYTHON) --version >/dev/null 2>&1; then command -v $(PYTHON); \
	elif command -v pyenv >/dev/null 2>&1; then ls -d "$$(pyenv root)"/versions/$(PYVER)*/bin/$(PYTHON) 2>/dev/null | sort -V | tail -n 1; fi)

STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python

MATRIX_VERSIONS ?= 0.17.1 0.18.2
MATRIX_TESTS ?= tests/test_install.py tests/test_install_distributed.py tests/test_guards.py tests/test_reduction.py
SOURCES ?= .cache/megatron-core-sources

.PHONY: setup demo test matrix clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -n "$(PYTHON_BIN)" || { echo "error: $(PYTHON) not found (neither on PATH nor under pyenv); install Python $(PYVER)" >&2; exit 2; }
	$(PYTHON_BIN) -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[megatron,test,plot]'
	@touch $@

demo: $(STAMP)
	$(VENV)/bin/megatron-ga verify

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The same hooks on the releases between the two legs: their megatron/core (the wheels' files) on PYTHONPATH.
matrix: $(STAMP)
	PYTHON=$(PY) bash tools/unpack-wheels.sh $(SOURCES) $(MATRIX_VERSIONS)
	set -e; for v in $(MATRIX_VERSIONS); do echo "== megatron-core $$v =="; \
		PYTHONPATH=$(SOURCES)/$$v $(PY) -m pytest -q -p no:cacheprovider $(MATRIX_TESTS); done

clean:
	rm -rf .venv .venv-* *.egg-info .pytest_cache .hypothesis
