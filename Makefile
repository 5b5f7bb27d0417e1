# Every target that needs Python depends on `setup`, which builds .venv once.
# LOOPBACK_ONLY=1 runs everything that starts Ray inside a loopback-only network namespace
# (ci/loopback.sh); CI sets it. On a laptop leave it unset.

SHELL := /bin/bash
.DEFAULT_GOAL := help

JOBS := $(sort $(patsubst jobs/%/main.py,%,$(wildcard jobs/*/main.py)))
JOB ?=
PROFILE ?= smoke
ARGS ?=
PYTEST_ARGS ?=

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NET := $(if $(filter 1,$(LOOPBACK_ONLY)),ci/loopback.sh,)

# Fail on a bad JOB before anything is installed or started.
ifneq ($(filter run-local,$(MAKECMDGOALS)),)
  ifeq ($(JOB),)
    $(error JOB is required, e.g. make run-local JOB=ddp; valid jobs: $(JOBS))
  endif
  ifeq ($(filter $(JOB),$(JOBS)),)
    $(error unknown JOB '$(JOB)'; valid jobs: $(JOBS))
  endif
endif

.PHONY: help setup run-local test test-unit lint clean

help: ## Show the targets
	@echo "usage: make <target> [JOB=<job>] [PROFILE=smoke|full] [ARGS=\"key=value ...\"]"
	@echo
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-11s %s\n", $$1, $$2}'
	@echo
	@echo "jobs: $(JOBS)"

setup: $(STAMP) ## Create .venv with the pinned stack (quick when already done)

$(STAMP): pyproject.toml constraints.txt ci/setup.sh
	ci/setup.sh
	@touch $@

run-local: setup ## Run JOB on a local Ray cluster: make run-local JOB=ddp [PROFILE=full] [ARGS="lr=1e-3"]
	$(NET) $(PY) jobs/$(JOB)/main.py --profile $(PROFILE) $(ARGS)

test: setup ## All tests: unit + end-to-end on a real local Ray cluster
	$(NET) $(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup ## Only the fast tests (no Ray cluster)
	$(NET) $(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)

lint: setup ## pre-commit hooks over the whole tree (ruff, ruff-format, yamllint, whitespace)
	$(PY) -m pre_commit run --all-files --show-diff-on-failure

clean: ## Remove runs, caches and build outputs (keeps .venv)
	rm -rf runs build .pytest_cache .ruff_cache
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +
