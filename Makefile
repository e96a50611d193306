# The README's commands. `make demo` and `make test` set everything up on a fresh machine.
#   make test                       primary leg: Python 3.12, newest megatron-core (0.19.2)
#   make test PYTHON=python3.11     compatibility leg: megatron-core 0.16.1, torch 2.13.0 (CPU)
#   make e2e [MEGATRON_LM=DIR|TGZ]  Megatron-LM's own pretrain_gpt.py end to end (default: the snapshots in
#                                   ../shared/upstream that run on this Python)
#   make matrix                     the behaviour suite on every tested source of this Python
#   make patches-check              patches/upstream (fixes to megatron-core): apply, tests fail before, pass after
#   make regress MEGATRON_LM=DIR|TGZ  both, on the Megatron-LM checkout you train from, after listing its drift:
#                                   parser flags the coverage table does not classify, hooked functions changed
#   make fuzz                       10,000 hypothesis examples on each input surface
#   make verify-fuzz                verify --fuzz 200 on three seeds, with each aux correction reverted too
#                                   (tools/verify_fuzz.py, about an hour): rows for docs/reduction.md's table
#   make test-O                     the fast suite (nothing that imports megatron-core) under python -O
#   make lint                       ruff over the tree, mypy over every layer but testing/ (pyproject.toml; CI)
#   make corpus                     the real-text corpus (benchmarks/corpus.py): .cache/corpus, built once
#   make critical-batch             the critical-batch benchmark (benchmarks/critical_batch.py, 1.5-2 h, resumable);
#                                   issue 51's runs: CRITICAL_BATCH_ARGS="--phase large" (then edges, branch, arms;
#                                   45 min); then CRITICAL_BATCH_ARGS=--collect for the JSON in benchmarks/results,
#                                   and make docs
#   make critical-batch-quick       its pipeline in about a minute, measuring nothing (CI runs it)
#   make test-bridge                Megatron-Bridge 0.6.2's own pretrain() end to end (tests/bridge; CI runs it):
#                                   .venv-bridge holds Bridge's pins over the primary leg's venv (docs/bridge.md)
#   make docs                       render the generated parts of docs/ (tools/docs.py)
#   make docs-check                 fail where a part rendered from code alone is not current (CI runs it)
#   make wheel-check                build the wheel, install it in a fresh venv, run it (CI runs it)
#   make gpu-wheels                 here (registry access): what make gpu-check installs offline, into
#                                   .cache/gpu-wheels (the list: tools/gpu-wheels.txt)
#   make gpu-check [PLAN=1]         on one GPU, no network, under 8 min: tests/gpu, the CUDA-graph rows, verify
#                                   --device cuda, gpu_overhead.sh; results in $OUT or .cache/gpu-check
#
# No test writes a tracked file. fuzz, e2e, matrix and regress record their measurements as JSON under
# .cache/results (RESULTS; git ignores .cache/), and so does verify-fuzz; `make docs` renders them into
# docs/compatibility.md, reliability.md, performance.md and reduction.md, keeping the rows no run recorded (another leg's sources; delete
# .cache/results to drop older records). Those tables hold timings and dates, so no check compares them: after `make fuzz` or
# `make e2e`, run `make docs` and commit the pages.
# The parts rendered from code alone (the flags table of docs/guide.md, docs/coverage.md, the text of
# docs/compatibility.md above its table) are the same on every run: `make docs-check` compares them byte for byte.
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

E2E_STAMP := $(VENV)/.installed-e2e
LINT_STAMP := $(VENV)/.installed-lint
RESULTS ?= $(CURDIR)/.cache/results
MEGATRON_LM ?=
MEGATRON_LM_SNAPSHOTS ?= ../shared/upstream
export MEGATRON_LM MEGATRON_LM_SNAPSHOTS

.PHONY: setup demo test test-O lint fuzz verify-fuzz matrix patches-check e2e regress corpus critical-batch critical-batch-quick test-bridge docs docs-check wheel-check fingerprints clean

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

# No check may rest on assert, which python -O strips.
test-O: $(STAMP)
	$(PY) -O -m pytest -q -p no:cacheprovider -m 'not slow and not gpu and not e2e and not bridge' $(PYTEST_ARGS)

$(LINT_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[megatron,test,plot,lint]'
	@touch $@

# ruff's rules and mypy's files are in pyproject.toml.
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# tests/test_fuzz.py at FUZZ_EXAMPLES per surface, in two processes (one per core), each half of the surfaces.
FUZZ_EXAMPLES ?= 10000
FUZZ_HALVES := "check_launch_lines or ledger_arguments or number_spelling or calculator_update" \
	"schedule_parser or rampup_converter"
fuzz: $(STAMP)
	@status=0; pids=""; for surfaces in $(FUZZ_HALVES); do \
		MEGATRON_GA_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) MEGATRON_GA_RESULTS=$(RESULTS) \
		$(PY) -m pytest -q -p no:cacheprovider -m fuzz tests/test_fuzz.py -k "$$surfaces" $(PYTEST_ARGS) & \
		pids="$$pids $$!"; \
	done; for pid in $$pids; do wait $$pid || status=1; done; exit $$status

verify-fuzz: $(STAMP)
	MEGATRON_GA_RESULTS=$(RESULTS) $(PY) -m tools.verify_fuzz $(VERIFY_FUZZ_ARGS)

$(E2E_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[megatron,test,plot,e2e]'
	@touch $@

# The behaviour suite (install, guards, reduction, PP 2 x DP 2 through install()) on every tested source of
# this Python: the snapshots (or MEGATRON_LM), else the released wheels' megatron/core. A snapshot's install tests
# import megatron/training (what install() hooks there), so the suite needs the e2e extra's packages too.
matrix: $(E2E_STAMP)
	MEGATRON_GA_RESULTS=$(RESULTS) $(PY) tools/regress.py behaviour $(MEGATRON_LM)

# The fixes to megatron-core itself (patches/upstream, docs/upstream.md): each applies to its pristine source, alone
# and in series, and the upstream-style tests (tests/upstream_style, two gloo ranks) fail before and pass after, on
# 0.19.2 and main d98e8a64 (MEGATRON_LM_SNAPSHOTS); about 4 minutes. PATCHES_SOURCE=megatron-core-0.19.2 checks one
# source (CI: about 2.5 minutes).
PATCHES_SOURCE ?=
patches-check: $(STAMP)
	$(PY) patches/upstream.py check $(if $(PATCHES_SOURCE),--source $(PATCHES_SOURCE))

e2e: $(E2E_STAMP)
	@$(PY) tools/regress.py sources $(MEGATRON_LM) >/dev/null
	MEGATRON_GA_RESULTS=$(RESULTS) $(PY) -m pytest -q -p no:cacheprovider -m e2e tests/e2e $(PYTEST_ARGS)

# check's verdicts and numbers held to Megatron-LM's own parse_args/validate_args/calculator/TransformerConfig on
# tests/oracle/corpus.jsonl, from the snapshots of core_v0.19.0 and main d98e8a64 (MEGATRON_LM_SNAPSHOTS); each
# disagreement is written to /tmp/oracle/disagreements.txt (MEGATRON_GA_ORACLE_REPORT).
.PHONY: oracle
oracle: $(E2E_STAMP)
	$(PY) -m pytest -q -s -p no:cacheprovider -m oracle tests/oracle $(PYTEST_ARGS)

corpus: $(STAMP)
	$(PY) -m benchmarks.corpus

critical-batch: $(E2E_STAMP)
	$(PY) benchmarks/critical_batch.py $(CRITICAL_BATCH_ARGS)

critical-batch-quick: $(E2E_STAMP)
	$(PY) benchmarks/critical_batch.py --quick

# Bridge's pins (constraints/bridge.txt) in their own venv, over the primary venv's torch, megatron-core and this
# package (a .pth that adds its site-packages); nvidia-resiliency-ext 0.6.0 is published for glibc 2.39 only, and
# its library needs 2.32: installed by its platform tag.
BRIDGE_VENV := .venv-bridge
BRIDGE_SITE := $(BRIDGE_VENV)/lib/python3.12/site-packages
BRIDGE_STAMP := $(BRIDGE_VENV)/.installed
$(BRIDGE_STAMP): constraints/bridge.txt
	$(MAKE) $(if $(filter 3.12,$(PYVER)),$(E2E_STAMP),PYTHON=python3.12 .venv/.installed-e2e)
	rm -rf $(BRIDGE_VENV)
	$(PYTHON_BIN) -m venv $(BRIDGE_VENV)
	echo "import site; site.addsitedir('$(CURDIR)/.venv/lib/python3.12/site-packages')" > $(BRIDGE_SITE)/primary-venv.pth
	$(BRIDGE_VENV)/bin/pip install --quiet --no-deps -r constraints/bridge.txt
	$(BRIDGE_VENV)/bin/pip install --quiet --no-deps --only-binary=:all: --platform manylinux_2_39_x86_64 \
		--python-version 3.12 --implementation cp --target $(BRIDGE_SITE) nvidia-resiliency-ext==0.6.0
	@touch $@

test-bridge: $(BRIDGE_STAMP)
	$(BRIDGE_VENV)/bin/python -m pytest -q -p no:cacheprovider -m bridge tests/bridge $(PYTEST_ARGS)

regress: $(E2E_STAMP)
	@test -n "$(MEGATRON_LM)" || { echo "make regress: pass MEGATRON_LM=<Megatron-LM checkout or .tar.gz>" >&2; exit 2; }
	$(PY) tools/regress.py drift $(MEGATRON_LM)
	MEGATRON_GA_RESULTS=$(RESULTS) $(PY) tools/regress.py behaviour $(MEGATRON_LM)
	MEGATRON_GA_RESULTS=$(RESULTS) $(PY) -m pytest -q -p no:cacheprovider -m e2e tests/e2e $(PYTEST_ARGS)

docs: $(STAMP)
	$(PY) -m tools.docs --results $(RESULTS)

docs-check: $(STAMP)
	$(PY) -m tools.docs --check

# The wheel and the sdist from this checkout; the wheel in a fresh venv: --version, check, install() on megatron-core.
wheel-check:
	@test -n "$(PYTHON_BIN)" || { echo "error: $(PYTHON) not found (neither on PATH nor under pyenv); install Python $(PYVER)" >&2; exit 2; }
	bash tools/check-wheel.sh $(PYTHON_BIN) $(CONSTRAINTS)

# After adding a source to compat.UPSTREAM: fingerprints of its hooked functions, from the snapshots.
fingerprints: $(STAMP)
	$(PY) -c 'from tools import regress; [regress.tree(regress.snapshot_dir() / f"megatron-lm-{u.ref}.tar.gz") for u in regress.UPSTREAM]'
	for source in megatron-core-0.19.2 megatron-lm-d98e8a64; do $(PY) patches/upstream.py tree --source $$source; done
	$(PY) -m megatron_ga_ext.integration.compat --snapshots .cache/megatron-lm --write

# The memory ledger against upstream's theoretical_memory_usage.py and FLOPs, from the snapshots (a few seconds).
.PHONY: oracle-memory
oracle-memory: $(STAMP)
	MEGATRON_GA_RESULTS=$(RESULTS) $(PY) -m pytest -q -s -p no:cacheprovider -m oracle tests/test_memory_upstream.py $(PYTEST_ARGS)

clean:
	rm -rf .venv .venv-* *.egg-info .pytest_cache .hypothesis

# The GPU check's two halves (tools/gpu_check.py), neither on this Makefile's venv: the GPU image's python3 holds torch.
GPU_PYTHON ?= python3
.PHONY: gpu-wheels gpu-check
gpu-wheels:
	$(GPU_PYTHON) tools/gpu_check.py wheels

gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py $(if $(PLAN),plan,run)
