# The two set-up commands of the README: `make serve` and `make test`.
# Each installs what it needs (OpenBLAS on Linux, a virtual environment) and runs.
PYTHON ?= python3
VENV ?= .venv
ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve test test-fast lint system venv

serve: venv
	$(VENV)/bin/gmlx serve $(ARGS)

test: venv
	$(VENV)/bin/python -m pytest -q $(ARGS)

test-fast: venv
	$(VENV)/bin/python -m pytest -q -m "not slow" $(ARGS)

# The formatter and the linter, as configured in pyproject.toml; CI runs this before the tests.
lint: venv
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/ruff check src tests bench

# MLX's Linux CPU wheel links the reference BLAS; gmlx preloads OpenBLAS instead (docs/ARCHITECTURE.md, decision 4).
# gmlx.kernels (the `gguf` weight mode) is compiled at install: a C++ compiler and Python's headers.
# Without them the install still succeeds and gmlx runs on MLX's own kernels.
system:
	@if [ "$$(uname)" = Linux ]; then \
	  pkgs=""; \
	  $(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || pkgs="$$pkgs python3 python3-venv"; \
	  ldconfig -p | grep -q 'libopenblas.so.0' || pkgs="$$pkgs libopenblas0-pthread"; \
	  command -v c++ >/dev/null || pkgs="$$pkgs g++"; \
	  command -v haproxy >/dev/null || pkgs="$$pkgs haproxy"; \
	  command -v promtool >/dev/null || pkgs="$$pkgs prometheus"; \
	  $(PYTHON) -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
	    2>/dev/null || pkgs="$$pkgs python3-dev"; \
	  if [ -n "$$pkgs" ]; then \
	    if command -v apt-get >/dev/null; then \
	      $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $$pkgs; \
	    else echo "warning: install$$pkgs with your package manager (OpenBLAS: fast CPU matmul; compiler, headers: gmlx.kernels)"; fi; \
	  fi; \
	fi

venv: system $(VENV)/.installed

$(VENV)/.installed: pyproject.toml CMakeLists.txt $(wildcard csrc/* csrc/kernels/*)
	[ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[demo,test]'
	touch $@
