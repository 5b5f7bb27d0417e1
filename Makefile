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
WAIT ?=
IMAGE ?=
STORAGE ?=
STORAGE_CLASS ?=
MAX_WAIT_S ?=
DEST ?=
KIND_CLUSTER ?= ray-templates

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NET := $(if $(filter 1,$(LOOPBACK_ONLY)),ci/loopback.sh,)
# Tests never report Ray usage statistics (README "Telemetry" says how users opt out).
NO_USAGE_STATS := RAY_USAGE_STATS_ENABLED=0
# `make submit` runs from a venv holding only the anyscale CLI: no training packages are built
# (DeepSpeed's setup.py runs at install) where the Anyscale token is in the environment.
SUBMIT_VENV := build/anyscale-cli
ANYSCALE_PIN := $(shell grep -E '^anyscale==' constraints.txt)
S3_STATE ?= build/s3
S3_BUCKET ?= templates
# While `make s3-up`'s server runs, every target gets its standard AWS_* variables.
-include $(S3_STATE)/env.mk

# Fail on a bad JOB (or DEST) before anything is installed or started.
JOB_TARGETS := run-local run-cluster submit render-kuberay run-kuberay kind-image template stack
ifneq ($(filter $(JOB_TARGETS),$(MAKECMDGOALS)),)
  ifeq ($(JOB),)
    $(error JOB is required, e.g. make $(firstword $(filter $(JOB_TARGETS),$(MAKECMDGOALS))) JOB=ddp; valid jobs: $(JOBS))
  endif
  ifeq ($(filter $(JOB),$(JOBS)),)
    $(error unknown JOB '$(JOB)'; valid jobs: $(JOBS))
  endif
endif
ifneq ($(filter template,$(MAKECMDGOALS)),)
  ifeq ($(DEST),)
    $(error DEST is required, e.g. make template JOB=$(JOB) DEST=../my-$(JOB)-job)
  endif
endif

.PHONY: help setup run-local test test-unit lint clean stack tensorboard \
	run-cluster submit compute-configs test-dist test-e2e containerfiles render-kuberay run-kuberay kuberay-crds \
	kind-up kind-image kind-down template validate plan bench dry-run anyscale-cli s3-up s3-down \
	export

help: ## Show the targets
	@echo "usage: make <target> [JOB=<job>] [PROFILE=smoke|full] [ARGS=\"key=value ...\"]"
	@echo
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-15s %s\n", $$1, $$2}'
	@echo
	@echo "jobs: $(JOBS)"

setup: $(STAMP) ## Create .venv with the pinned stack (quick when already done)

$(STAMP): pyproject.toml constraints.txt ci/setup.sh
	ci/setup.sh
	@touch $@

run-local: setup ## Run JOB on a local Ray cluster: make run-local JOB=ddp [PROFILE=full] [ARGS="lr=1e-3"]
	$(NET) $(PY) jobs/$(JOB)/main.py --profile $(PROFILE) $(ARGS)

# ARGS="--storage-path s3://bucket/runs" for runs stored elsewhere than runs/.
export: setup ## HF model dir from a run's checkpoint: make export JOB=ddp RUN=<run_name> [STEP=n] [DEST=dir]
	@test -n "$(JOB)" -a -n "$(RUN)" || { echo "usage: make export JOB=<job> RUN=<run_name> [STEP=n] [DEST=dir]" >&2; exit 2; }
	$(PY) -m shared.export --job $(JOB) --run $(RUN) $(if $(STEP),--step $(STEP),) \
		$(if $(DEST),--dest $(DEST),) $(ARGS)

# No `setup` prerequisite: this runs beside a live job and must never start a reinstall.
stack: ## Python stacks of JOB's running driver + workers: make stack JOB=ddp [ARGS="--run NAME"]
	$(PY) -m shared.observability.stack --job $(JOB) $(ARGS)

tensorboard: setup ## TensorBoard over every run under runs/ (http://127.0.0.1:6006)
	$(VENV)/bin/tensorboard --logdir runs --host 127.0.0.1

# Not wrapped in $(NET): under LOOPBACK_ONLY=1 the server must live in the namespace the jobs
# use, so run the whole sequence inside one ci/loopback.sh (s3-up refuses otherwise).
s3-up: setup ## Local S3 server (SeaweedFS on 127.0.0.1) + a bucket (S3_BUCKET=templates); prints the AWS_* exports
	$(PY) -m ci.s3_server up --state $(S3_STATE) --bucket $(S3_BUCKET)

s3-down: ## Stop the local S3 server started by s3-up (by its PID) and delete its data
	$(PY) -m ci.s3_server down --state $(S3_STATE)

# --- the same job on a cluster: local multi-node, Anyscale, KubeRay (README: "Run it on a cluster")
run-cluster: setup ## JOB on a local head + worker node via the Ray Jobs API (ray job submit)
	$(NET) $(PY) -m ci.run_cluster --job $(JOB) --profile $(PROFILE) $(ARGS)

anyscale-cli: $(SUBMIT_VENV)/.installed ## The small venv `make submit` uses (anyscale CLI only)

$(SUBMIT_VENV)/.installed: constraints.txt
	$(or $(PYTHON),python3) -m venv $(SUBMIT_VENV)
	$(SUBMIT_VENV)/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt \
	  $(ANYSCALE_PIN) 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
	@touch $@

submit: anyscale-cli ## JOB on Anyscale: anyscale job submit -f jobs/JOB/job.yaml [WAIT=1 adds --wait]
	$(SUBMIT_VENV)/bin/python -m ci.anyscale_cli submit --job $(JOB) $(if $(filter 1,$(WAIT)),--wait,) $(if $(MAX_WAIT_S),--max-wait-s $(MAX_WAIT_S),)

compute-configs: setup ## Register compute_configs/*.yaml on Anyscale under their file names
	$(PY) -m ci.anyscale_cli compute-configs

containerfiles: setup ## Rewrite images/Containerfile + jobs/*/Containerfile from images/requirements.txt
	$(PY) -m ci.images

KUBERAY_ARGS = --job $(JOB) --profile $(PROFILE) $(if $(IMAGE),--image $(IMAGE),) \
	$(if $(STORAGE),--storage $(STORAGE),) $(if $(STORAGE_CLASS),--storage-class $(STORAGE_CLASS),)

render-kuberay: setup ## build/JOB/*.yaml: a KubeRay RayJob from job.yaml [IMAGE=... STORAGE=kind|pvc|s3://...]
	$(PY) -m ci.kuberay render $(KUBERAY_ARGS)

run-kuberay: setup ## Render, apply to the current kubectl context, wait, print logs; fail unless SUCCEEDED
	$(PY) -m ci.kuberay run $(KUBERAY_ARGS)

kuberay-crds: setup ## Fetch the pinned KubeRay RayJob CRD (into ci/kuberay/, or KUBERAY_CRD_DIR)
	$(PY) -m ci.kuberay fetch-crds

kind-up: ## kind cluster + KubeRay operator 1.7.0 via helm (needs docker, kind, helm, kubectl)
	KIND_CLUSTER=$(KIND_CLUSTER) ci/kind-up.sh

kind-image: ## Build jobs/JOB/Containerfile and load it into kind (then: make run-kuberay IMAGE=train-JOB:dev)
	docker build -t train-$(JOB):dev -f jobs/$(JOB)/Containerfile jobs/$(JOB)
	kind load docker-image train-$(JOB):dev --name $(KIND_CLUSTER)

kind-down: ## Delete the kind cluster
	kind delete cluster --name $(KIND_CLUSTER)

template: setup ## Standalone starter project for JOB: make template JOB=fsdp DEST=../my-job
	$(PY) -m ci.template --job $(JOB) --dest $(DEST)

plan: setup ## Memory per GPU of each strategy + a recommendation: make plan ARGS="--preset gpt2-xl --gpus 8 --gpu-mem 16GiB"
	$(PY) -m shared.planner $(ARGS)

# PROFILE defaults to full here (smoke elsewhere): a dry run is for the sizes never run locally.
dry-run: setup ## JOB at its real world size on one CPU (fake process group): make dry-run JOB=tp2d [PROFILE=full] [ARGS="tp=8"] [COMPUTE=8xH100]
	$(PY) -m shared.planner.dryrun --job $(JOB) --profile $(if $(filter command line environment,$(origin PROFILE)),$(PROFILE),full) $(if $(COMPUTE),--compute $(COMPUTE)) $(ARGS)

bench: setup ## DDP/FSDP2/ZeRO-1/2/3/TPxDP on the local cluster -> docs/benchmarks.md + .png (~10 min)
	$(NET) $(PY) benchmarks/bench.py $(ARGS)

# Two pytest workers, one test file each at a time (files share their runs through module
# fixtures). The e2e runs keep both cores busy: a third worker made the suite slower here
# (21:51 against 19:36 for the tests, measured on fresh clones).
# The tiers (docs/testing.md): tests/unit (one process), tests/dist (gloo ranks, no Ray),
# tests/e2e (Ray, the S3 server, clusters). The 20 slowest tests are printed at the end.
TEST_WORKERS ?= 2
PYTEST := $(NO_USAGE_STATS) $(NET) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile \
	--no-loadscope-reorder --durations=20

test: setup ## All three tiers: unit + dist (gloo) + end-to-end on real Ray and S3 (~18 min, 2 cores)
	$(PYTEST) $(PYTEST_ARGS)

VALIDATE_TESTS := tests/unit/test_deploy.py tests/unit/test_kuberay.py tests/unit/test_pins.py \
	tests/unit/test_ci_config.py tests/unit/test_template.py

validate: setup ## Offline checks: job.yaml, compute configs + instance types, images' CUDA, pins, RayJobs, workflows, template
	$(NO_USAGE_STATS) $(PY) -m pytest $(VALIDATE_TESTS) $(PYTEST_ARGS)

test-unit: setup ## The unit tier: one process each, no Ray, no server, no process group (~3 min)
	$(PYTEST) tests/unit $(PYTEST_ARGS)

test-dist: setup ## The dist tier: real gloo process groups without Ray (strategies, resume, TP)
	$(PYTEST) tests/dist $(PYTEST_ARGS)

test-e2e: setup ## The e2e tier: jobs through Ray Train, S3, kills, elastic, the make commands
	$(PYTEST) tests/e2e $(PYTEST_ARGS)

lint: setup ## pre-commit: ruff, yamllint, hadolint, workflow schema + actionlint, whitespace
	$(PY) -m pre_commit run --all-files --show-diff-on-failure

clean: ## Remove runs, caches and build outputs (keeps .venv)
	rm -rf runs build .pytest_cache .ruff_cache
	find . -name __pycache__ -not -path "./$(VENV)/*" -prune -exec rm -rf {} +
