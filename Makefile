# The two set-up commands of the README: `make serve` and `make test`.
# Each installs what it needs (OpenBLAS on Linux, a virtual environment) and runs.
PYTHON ?= python3
VENV ?= .venv
ARGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve test test-fast system venv

serve: venv
	$(VENV)/bin/gmlx serve $(ARGS)

test: venv
	$(VENV)/bin/python -m pytest -q $(ARGS)

test-fast: venv
	$(VENV)/bin/python -m pytest -q -m "not slow" $(ARGS)

# MLX's Linux CPU wheel links the reference BLAS; gmlx preloads OpenBLAS instead (DESIGN.md, 4).
system:
	@if [ "$$(uname)" = Linux ] && ! ldconfig -p | grep -q 'libopenblas.so.0'; then \
	  if command -v apt-get >/dev/null; then \
	    $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libopenblas0-pthread; \
	  else echo "warning: install OpenBLAS with your package manager for fast CPU matmul"; fi; \
	fi

venv: system $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	[ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[demo,test]'
	touch $@
