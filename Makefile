# Two entry points, each self-sufficient on a fresh machine with only Python 3.10+:
#   make demo   - local fault-tolerant training demo with an injected failure
#   make test   - the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.torchheal-installed

.PHONY: demo test lint bench setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh scripts/dashboard_assets.sh torchheal/coordination/dashboard/package-lock.json
	PY=$(PY) VENV=$(VENV) bash scripts/setup_env.sh
	touch $@

demo: $(STAMP)
	$(BIN)/torchheal demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check torchheal tests bench examples scripts

bench: $(STAMP)
	$(BIN)/python bench/quorum.py

clean:
	rm -rf $(VENV) build *.egg-info
