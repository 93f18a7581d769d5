# The two commands: `make up` (a local cluster) and `make test`. Both create .venv/ first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch (from local disk here); an unpinned torch would pull GBs of CUDA builds.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=

.PHONY: up test stubs clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e ".[test]"
	touch $@

up: $(VENV)/.base
	$(VENV)/bin/pdserve up $(ARGS)

test: $(VENV)/.test
	$(PY) -m pytest -q $(PYTEST_ARGS)

stubs: $(VENV)/.test
	$(PY) -m protos.generate_stubs

clean:
	rm -rf $(VENV) *.egg-info
