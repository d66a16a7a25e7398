# mixprec developer entry points. Every target sets up .venv first (idempotent).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mixprec-installed

.PHONY: setup demo test test-fast test-nobf16 test-gpu lint bench docs clean

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints-dev.txt -e '.[cli,dev,docs,transformers,accelerate,lightning,bench]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/mixprec demo

test: setup
	$(PY) -m pytest -q

# Unit tests only: no multi-process, slow or third-party-framework tests.
test-fast: setup
	$(PY) -m pytest -q -m "not distributed and not slow and not integration"

# The unit tests as on a CPU without bf16 instructions (AVX2 laptops, many cloud VMs):
# oneDNN honours ONEDNN_MAX_CPU_ISA, so bf16 kernels run emulated, 40x slower than fp32.
test-nobf16: setup
	ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q -m "not distributed and not slow and not integration"

# The CUDA tier (tests/cuda): every test is skipped, with the reason, without a GPU.
test-gpu: setup
	$(PY) -m pytest -q -m cuda tests/cuda

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

bench: setup
	$(PY) benchmarks/run_all.py

# The documentation site, built strictly (any warning fails) into site/.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
