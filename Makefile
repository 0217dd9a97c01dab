# Everything a fresh machine needs: `make demo` and `make test` create .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: demo test lint format docs bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e ".[dev,bench]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# The suite in 2 worker processes (pytest-xdist), one test file per worker at a time: most of
# its time is subprocesses starting TensorFlow, JAX or torch, which leave a core idle. CI has
# 2 cores.
PYTEST_WORKERS ?= 2

test: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) docs/build_api.py
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The API reference, offline HTML from the docstrings (pdoc): docs/api/index.html.
docs: $(VENV)/.installed-dev
	$(PY) docs/build_api.py

format: $(VENV)/.installed-dev
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(VENV)/.installed-dev
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) demo_data benchmarks/results .pytest_cache .ruff_cache .mypy_cache docs/api
