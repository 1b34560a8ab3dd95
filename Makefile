# Two commands do all set-up on a fresh machine:  `make run` (the main job) and `make test` (lint + tests).
# Both create .venv on first use. TORCH pins the CPU build that lies on CI's disk; on a GPU machine use e.g.
# `make run TORCH=torch` (or install into an environment that already has CUDA torch and call the scripts).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
# Test workers (pytest-xdist): most tests wait on Python processes that they start, each busy on one core; two
# workers keep a 2-core machine busy. JOBS=0 runs every test in the pytest process itself.
JOBS ?= 2

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)" -e '.[dev,fp8]'
	touch $@

.PHONY: run test lint
run: $(VENV)/.installed
	$(PY) compare.py $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -n $(JOBS) --dist worksteal $(ARGS)
