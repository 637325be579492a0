# Brownout — the two commands: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Install stamps, keyed on pyproject.toml (and setup.py, the C scanner): `make run` installs what running
# needs (the proxy, the fallback server, the tiny model: `.[fallback]`);
# `make test` adds the test and lint tools and the optional OpenTelemetry
# exporter on top (`.[fallback,test,otel]`).
# setup.py builds the C scanner (proxy/openai/_runscan.c): a change reinstalls.
PYPROJECT_HASH := $(shell cat pyproject.toml setup.py proxy/openai/_runscan.c | md5sum | cut -c1-8)
RUN_STAMP := $(VENV)/.installed-run-$(PYPROJECT_HASH)
TEST_STAMP := $(VENV)/.installed-test-$(PYPROJECT_HASH)
PIP := PIP_DISABLE_PIP_VERSION_CHECK=1 $(PY) -m pip install -q

.PHONY: setup setup-run run test lint typecheck unit vllm-venv crd-check bench chaos fuzz litellm-venv clean

setup: $(TEST_STAMP)
setup-run: $(RUN_STAMP)

# torch first, its CPU build (a bare `torch` requirement would pull a
# multi-GB CUDA build): a wheel on the machine's disk, else PyTorch's CPU
# index (scripts/install-torch.sh; TORCH_INDEX=URL overrides it).
$(RUN_STAMP): pyproject.toml
	@echo "== installing the proxy, the fallback server and torch (CPU) into $(VENV) (once, about a minute)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@PIP_DISABLE_PIP_VERSION_CHECK=1 scripts/install-torch.sh $(PY)
	@$(PIP) -e '.[fallback]'
	@rm -f $(VENV)/.installed-*
	@touch $@

$(TEST_STAMP): $(RUN_STAMP)
	@echo "== installing the test and lint tools and the otel extra into $(VENV)"
	@$(PIP) -e '.[fallback,test,otel]'
	@touch $@

# The proxy on :8080 in front of the fallback server on the tiny model (:8001);
# a vLLM on :8000 is used as the primary when one runs.
run: setup-run
	@PATH=$(VENV)/bin:$$PATH scripts/quickstart.sh

# The vLLM CPU build used by the real-server tests (cached outside the repo).
vllm-venv:
	scripts/ensure-vllm-venv.sh

# The Prometheus Operator API check of deploy/k8s's monitoring objects
# (tests/deploy/crd, Node.js): its npm packages, as locked.
CRD_CHECK := tests/deploy/crd
$(CRD_CHECK)/node_modules/.installed: $(CRD_CHECK)/package.json $(CRD_CHECK)/package-lock.json
	cd $(CRD_CHECK) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

crd-check: $(CRD_CHECK)/node_modules/.installed

lint:
	$(VENV)/bin/ruff check proxy tests bench fuzz scripts
	$(VENV)/bin/ruff format --check proxy tests bench fuzz scripts

typecheck:
	$(VENV)/bin/mypy

test: setup vllm-venv crd-check lint typecheck
	$(VENV)/bin/pytest -q

unit: setup
	$(VENV)/bin/pytest -q tests/unit

# Benchmarks against nginx, a bare aiohttp relay and LiteLLM (needs wrk; the
# LiteLLM proxy lives in its own cached venv; valgrind for the instruction
# counts). Writes bench/results/latest.md, overhead.md, guard.md, rollout-cost.md,
# otel-cost.md and guardrails.md (every optional feature's on/off cost against its budget).
LITELLM_VENV ?= $(HOME)/.cache/brownout/litellm-venv
litellm-venv:
	test -x $(LITELLM_VENV)/bin/python || ( $(PYTHON) -m venv $(LITELLM_VENV).tmp && \
	  $(LITELLM_VENV).tmp/bin/python -m pip install -q 'litellm[proxy]' && \
	  mv $(LITELLM_VENV).tmp $(LITELLM_VENV) )

bench: setup vllm-venv litellm-venv
	command -v wrk >/dev/null || apt-get install -y -q wrk
	command -v valgrind >/dev/null || apt-get install -y -q valgrind
	$(PY) -m pip install -q matplotlib
	$(PY) bench/run.py
	$(PY) bench/overhead.py
	$(PY) bench/guard_ab.py
	$(PY) bench/guard_bench.py
	$(PY) bench/replay_speed.py --hours 1 --out bench/results/replay.md
	if command -v valgrind >/dev/null; then $(PY) bench/instr.py . --recorder \
	  | tee bench/results/recorder-cost.md; else echo "valgrind missing: recorder cost not measured"; fi
	$(PY) bench/rollout_ab.py
	$(PY) bench/otel_ab.py
	$(PY) bench/guardrails.py

# Coverage-guided fuzzing of the request and SSE parsers and the guard.
FUZZ_SECONDS ?= 120
fuzz: setup
	$(PY) -m pip install -q atheris
	$(PY) fuzz/fuzz_parsers.py -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=1024

# The long chaos drills against the real stack. Writes bench/results/chaos.md.
chaos: setup vllm-venv
	$(PY) bench/chaos.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache $(CRD_CHECK)/node_modules
