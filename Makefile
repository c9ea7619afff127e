# Two entry points for a fresh machine: `make demo` (main job) and `make test`.
# Each creates or updates the local virtual environment first; re-running is cheap.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test lint setup bench clean floors test-other-cpu

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rmm-jax demo

test: $(STAMP)
	$(PY) -m pytest -q -ra --numprocesses auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The documentation site (mkdocs.yml): the docs extra, then a strict build into site/.
# Phony: the docs/ directory would otherwise make the target look up to date.
.PHONY: docs
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -c constraints.txt -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The lowest versions pyproject.toml allows (uv's lowest-direct resolution; the constraints'
# pins kept) in an environment of their own, and the suite and ruff run there: a floor that no
# longer holds fails here. Not part of CI: it installs a second environment (~15 min).
FLOORS ?= .venv-floors
floors:
	test -x $(FLOORS)/bin/python || $(PYTHON) -m venv $(FLOORS)
	$(FLOORS)/bin/python -m pip install -q uv
	$(FLOORS)/bin/uv pip install -q --python $(FLOORS)/bin/python --resolution lowest-direct -c constraints.txt \
		$(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) -e '.[test]'
	$(FLOORS)/bin/python -m pytest -q -ra --numprocesses auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder
	$(FLOORS)/bin/ruff check .

# The suite as another CPU computes it: XLA limited to SSE4.2 (no AVX/FMA: other vector widths,
# other summation orders), NumPy without its AVX2/AVX-512 kernels, OpenBLAS's Nehalem kernels.
# Every float tolerance in tests/ is an error bound, so it must hold here as on the machine that
# wrote it. Not part of CI (it runs the whole suite again).
test-other-cpu: $(STAMP)
	XLA_FLAGS=--xla_cpu_max_isa=SSE4_2 OPENBLAS_CORETYPE=Nehalem \
	NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4 AVX512_ICL AVX512_SPR AVX512_SKX AVX512_CLX AVX512_CNL" \
	$(PY) -m pytest -q -ra --numprocesses auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) $(FLOORS) .pytest_cache build *.egg-info
