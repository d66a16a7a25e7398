# mixprec developer entry points. Every target sets up .venv first (idempotent).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mixprec-installed
# The minimum-versions environment (`make test-min`), pinned in constraints-min.txt.
VENV_MIN  ?= .venv-min
PY_MIN    := $(VENV_MIN)/bin/python
STAMP_MIN := $(VENV_MIN)/.mixprec-installed

.PHONY: setup demo test test-long test-fast test-nobf16 test-gpu test-min lint bench docs clean

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints-dev.txt -e '.[cli,dev,docs,transformers,accelerate,lightning,peft,bench,triton]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/mixprec demo

# Two pytest workers (pytest-xdist), each test file on one of them: the multi-process
# tests spend much of their time starting processes, so two workers fit two cores.
XDIST := -n 2 --dist loadfile

# Everything but the `long` scenarios (each half a minute or more: several launches of
# processes, or a subprocess suite), which `make test-long` runs; CI runs both.
test: setup
	$(PY) -m pytest -q $(XDIST) -m "not long"

test-long: setup
	$(PY) -m pytest -q $(XDIST) -m long

# Unit tests only: no multi-process, slow or third-party-framework tests.
test-fast: setup
	$(PY) -m pytest -q -m "not distributed and not slow and not integration"

# The unit tests as on a CPU without bf16 instructions (AVX2 laptops, many cloud VMs):
# oneDNN honours ONEDNN_MAX_CPU_ISA, so bf16 kernels run emulated, 40x slower than fp32.
test-nobf16: setup
	ONEDNN_MAX_CPU_ISA=AVX2 $(PY) -m pytest -q $(XDIST) -m "not distributed and not slow and not integration"

# The CUDA tier (tests/cuda): every test is skipped, with the reason, without a GPU.
test-gpu: setup
	$(PY) -m pytest -q -m cuda tests/cuda

$(STAMP_MIN): pyproject.toml constraints-min.txt
	test -x $(PY_MIN) || $(PYTHON) -m venv $(VENV_MIN)
	$(PY_MIN) -m pip install --quiet --disable-pip-version-check -c constraints-min.txt -e '.[cli,dev,transformers,accelerate,lightning]'
	touch $(STAMP_MIN)

# The integration tests at the lowest transformers / accelerate / lightning that
# pyproject.toml accepts, in their own .venv-min (docs/versions.md).
test-min: $(STAMP_MIN)
	$(PY_MIN) -m pytest -q -m integration tests/integrations tests/test_scaling_compat.py

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

bench: setup
	$(PY) benchmarks/run_all.py

# The documentation site, built strictly (any warning fails) into site/.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) $(VENV_MIN) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
