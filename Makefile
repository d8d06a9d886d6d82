# `make demo` and `make test` each work on a fresh machine by themselves: they create .venv, install
# what they need, then run. On a CPU-only machine `torch==2.13.0` resolves to the local CPU build
# (a bare `torch` would pull gigabytes of CUDA wheels).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: demo test test-gpu clean

$(STAMP):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(BIN)/python -m moe demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
