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

DEMO_RUN := runs/demo-$(shell date +%Y%m%d-%H%M%S)

demo: $(STAMP)
	$(PY) -m rpt prepare --out data/stdlib
	$(PY) -m rpt train --config configs/demo-cpu.toml --run-dir $(DEMO_RUN)
	@echo; echo "A sample from the trained model:"; echo
	$(PY) -m rpt generate $(DEMO_RUN) --prompt "def parse_args(" --max-new-tokens 150 --seed 0
	@echo
	@echo "Next:"
	@echo "  $(PY) -m rpt eval $(DEMO_RUN)                      # validation loss, perplexity, bits per byte"
	@echo "  $(PY) -m rpt generate $(DEMO_RUN) --prompt 'class '  # more samples"
	@echo "  $(PY) -m rpt train --run-dir $(DEMO_RUN) --resume --set train.max_time=600   # train on"
	@echo "  $(PY) -m rpt monitor $(DEMO_RUN)                   # dashboard on http://127.0.0.1:8765/"

# one pytest worker a core, at most 4 (each worker's torch on one thread: tests/conftest.py); each test file runs
# on one worker, so that its module fixture runs once
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile --durations=25 tests

clean:
	rm -rf $(VENV) data runs .pytest_cache
