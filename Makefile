# k3lab: two commands on a fresh machine.
#   make run   - the whole suite on this machine, report in build/report.html
#   make test  - the whole test suite (notebooks included); skipped tests are summed up by reason
# Both make a virtual environment (.venv) unless one is already active, install
# what is missing, and never replace a torch that is already installed (a ROCm or
# CUDA build): the venv sees the system's packages, and torch is installed only
# when none can be imported.

SHELL := /bin/bash
PY_SYS ?= python3
ifdef VIRTUAL_ENV
  PY := $(VIRTUAL_ENV)/bin/python
  STAMP := $(VIRTUAL_ENV)/.k3lab-installed
else ifdef CONDA_PREFIX
  PY := $(CONDA_PREFIX)/bin/python
  STAMP := $(CONDA_PREFIX)/.k3lab-installed
else
  PY := .venv/bin/python
  STAMP := .venv/.k3lab-installed
endif
# torch 2.13.0 is the CPU build that lies on disk on the CPU machines here.
TORCH_SPEC ?= torch==2.13.0
# The same Triton as the lent H200 machine; installed only where no triton exists.
TRITON_SPEC ?= triton==3.6.0

.PHONY: run test install lint clean-build

# The two commands grade the workshop's tasks in their two roles (k3lab.workshop.grading): make run grades
# the reference solutions (K3LAB_WORKSHOP_GRADE=solutions: a broken reference fails the report), and make
# test runs every notebook as a learner first opens it, unsolved (each check says "not solved yet" and the
# lesson goes on with the reference, so nothing may halt; its guesses are not a learner's, so no predictions
# file is written). An explicit K3LAB_WORKSHOP_GRADE or K3LAB_PREDICTIONS wins in both.
run: $(STAMP)
	K3LAB_WORKSHOP_GRADE=$${K3LAB_WORKSHOP_GRADE-solutions} $(PY) -m k3lab.cli report

# required_plugins: the hang guard (pytest-timeout, in .[dev]; its limit is in pyproject.toml) must be there.
# Output: one line per test file or notebook, its dots as its tests pass, and the ten slowest tests at the end
# (no per-test names: the suite has over a thousand); a long test is the only pause.
test: $(STAMP)
	K3LAB_PREDICTIONS=$${K3LAB_PREDICTIONS-off} $(PY) -m pytest tests notebooks --nbval-lax --nbval-current-env -p no:cacheprovider \
	  -o required_plugins=pytest-timeout -o console_output_style=count --durations=10 --durations-min=30

lint: $(STAMP)
	$(PY) -m ruff check k3lab tests

install: $(STAMP)

.venv/bin/python:
	$(PY_SYS) -m venv --system-site-packages .venv

$(STAMP): pyproject.toml $(if $(VIRTUAL_ENV)$(CONDA_PREFIX),,.venv/bin/python)
	@$(PY) -c "import torch" 2>/dev/null && echo "k3lab: keeping the installed torch $$($(PY) -c 'import torch; print(torch.__version__)')" \
	  || { echo "k3lab: no torch found, installing $(TORCH_SPEC)"; $(PY) -m pip install -q "$(TORCH_SPEC)"; }
	@$(PY) -c "import triton" 2>/dev/null && echo "k3lab: keeping the installed triton" \
	  || { echo "k3lab: no triton found, installing $(TRITON_SPEC) (CPU: the interpreter)"; $(PY) -m pip install -q "$(TRITON_SPEC)"; }
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

clean-build:
	rm -rf build
