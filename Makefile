# The README's two commands. Each makes .venv when it is missing, installs rpt into it, then works.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m rpt prepare --out data/stdlib

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) data runs .pytest_cache
