# `make demo` and `make test` each work on a fresh machine by themselves: they create .venv, install
# what they need, then run. On a CPU-only machine `torch==2.13.0` resolves to the local CPU build
# (a bare `torch` would pull gigabytes of CUDA wheels, so nothing here lets pip choose torch).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# pip byte-compiles what it installs on one core (torch alone: ~30 s of a ~45 s install here); --no-compile and
# then compileall on every core does the same work in about half the time. Like pip's, a file that does not
# compile (a package's template or test data) is not an error.
PIP    := $(BIN)/pip install -q --disable-pip-version-check --no-compile
COMPILE = $(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
TORCH  ?= torch==2.13.0
HASH   := $(shell cat pyproject.toml Makefile examples/plugin_backend/pyproject.toml 2>/dev/null | cksum | cut -d' ' -f1)
BASE   := $(VENV)/.base-$(HASH)
TESTS  := $(VENV)/.test-$(HASH)

# FlashInfer's pure-torch helpers and signatures are tested on CPU. --no-deps keeps its requirements
# from replacing the CPU torch; these are the ones `import flashinfer` needs.
FLASHINFER := flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 requests charset-normalizer \
              idna urllib3 certifi nvidia-ml-py tqdm

.PHONY: demo test docs clean

$(BASE):
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH)"
	$(PIP) -e .
	$(COMPILE)
	rm -f $(VENV)/.base-*
	touch $@

# Triton kernels run on CPU under TRITON_INTERPRET=1; the example plugin tests the entry-point group;
# transformers builds the tiny random models of the integration tests (no downloads).
$(TESTS): $(BASE)
	$(PIP) -e '.[test]' "triton==3.9.0" matplotlib "transformers==5.25.0"
	$(PIP) --no-deps $(FLASHINFER)
	$(PIP) -e examples/plugin_backend
	$(COMPILE)
	rm -f $(VENV)/.test-*
	touch $@

demo: $(BASE)
	$(BIN)/python -m moe demo

# Without a GPU, Triton kernels run in its CPU interpreter (set before anything imports triton)
INTERPRET := $(if $(shell command -v nvidia-smi 2>/dev/null),,TRITON_INTERPRET=1)

# JOBS pytest workers (pytest-xdist): the CI machine's 2 cores; the interpreter tests are CPU-bound Python.
# worksteal: a worker that runs out takes half of the other's queue; with the default (load) one worker
# sat idle for ~90 s at the end while the other still held a queue of the slow interpreter tests
JOBS ?= 2

test: $(TESTS)
	$(INTERPRET) $(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal

# regenerate the support table in docs/writing-a-backend.md from the capability declarations
docs: $(BASE)
	$(BIN)/python -m moe.tools.docs

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
