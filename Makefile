# kiln developer entry points. Works on a fresh machine with only Python 3.11+ and a C++ compiler:
# the first target run creates .venv, installs torch (CPU build, pinned) and then kiln itself.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Installed first, on its own: an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.kiln-installed
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=
BENCH_ARGS ?=

export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: all setup demo test test-slow test-gpu bench bench-cpu bench-gpu lint format clean distclean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-runs only when pyproject.toml changes (or the venv is new).
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install "$(TORCH_SPEC)"
	$(PIP) install -e ".[dev]"
	$(PY) -m kiln.runtime  # libkiln built now, never while a package loads
	@touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kiln demo

# xdist when it is importable, a plain serial run otherwise.
define run_pytest
	@if $(PY) -c "import xdist" 2>/dev/null; then \
		echo "$(PY) -m pytest -n $(PYTEST_WORKERS) -q $(1) $(PYTEST_ARGS)"; \
		$(PY) -m pytest -n $(PYTEST_WORKERS) -q $(1) $(PYTEST_ARGS); \
	else \
		echo "$(PY) -m pytest -q $(1) $(PYTEST_ARGS)"; \
		$(PY) -m pytest -q $(1) $(PYTEST_ARGS); \
	fi
endef

test: $(STAMP)
	$(call run_pytest,)

test-slow: $(STAMP)
	$(call run_pytest,-m slow)

test-gpu: $(STAMP)
	$(call run_pytest,-m gpu)

bench: $(STAMP)
	$(PY) bench/run.py $(BENCH_ARGS)

# kiln against ONNX Runtime, OpenVINO, AOTInductor and eager (needs `pip install -e .[bench]`)
bench-cpu: $(STAMP)
	$(PY) bench/cpu_peers.py $(BENCH_ARGS)

# kiln vs eager vs torch.compile latency on the zoo models, fp32, on the local GPU.
bench-gpu: $(STAMP)
	$(PY) bench/gpu.py $(BENCH_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check kiln tests bench

format: $(STAMP)
	$(VENV)/bin/ruff check --fix kiln tests bench
	$(VENV)/bin/ruff format kiln tests bench

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache $(STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV)
