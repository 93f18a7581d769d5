# The two commands: `make up` (a local cluster) and `make test`. Both create .venv/ first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch (from local disk here); an unpinned torch would pull GBs of CUDA builds.
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
PYTEST_ARGS ?=

.PHONY: up test stubs chart-flags docs clean test-tools

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

test: $(VENV)/.test test-tools
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The metrics tests run a real Prometheus server: Debian's package, installed when we may.
test-tools:
	@command -v prometheus >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's prometheus for the metrics tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	  else echo "prometheus not found and not root: the Prometheus test will be skipped"; fi; }

stubs: $(VENV)/.test
	$(PY) -m protos.generate_stubs

# The Helm chart's list of each role's flags, from the config dataclasses (pdserve/config.py).
chart-flags: $(VENV)/.base
	$(PY) -c "import json; from pdserve.cli import CHART_FLAGS, chart_flags; \
	open(CHART_FLAGS, 'w').write(json.dumps(chart_flags(), indent=1, sort_keys=True) + '\n')"

# docs/configuration.md: every flag, from the config dataclasses (a test fails when it is stale).
docs: $(VENV)/.base
	$(PY) -c "from pdserve.config_docs import CONFIGURATION_DOC, configuration_markdown; \
	open(CONFIGURATION_DOC, 'w').write(configuration_markdown())"

clean:
	rm -rf $(VENV) *.egg-info
