# Two entry points, each self-sufficient on a fresh machine with only Python 3.10+:
#   make demo   - local fault-tolerant training demo with an injected failure
#   make test   - the whole test suite
# Not part of `make test` (needs two ~2.4 GB venvs, ~10 min on 2 cores):
#   make torchtitan - torchtitan 0.3.0 on torchheal, side by side with the reference (CPU)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.torchheal-installed

.PHONY: demo test lint bench setup clean torchtitan check-protocol

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup_env.sh scripts/dashboard_assets.sh torchheal/coordination/lighthouse/dashboard/package-lock.json
	PY=$(PY) VENV=$(VENV) bash scripts/setup_env.sh
	touch $@

# DEMO_ARGS passes options through, e.g. DEMO_ARGS="--steps 20 --kill-at-step 8".
demo: $(STAMP)
	$(BIN)/torchheal demo $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check torchheal tests bench examples scripts

bench: $(STAMP)
	$(BIN)/python bench/quorum.py

# The exhaustive interleaving checker of the commit protocol (issue 40) at its large size: every
# interleaving of failures over the real lighthouse core; prints the states explored and the
# invariants checked, and the trace of the first violation (exit status 1). The suite runs a
# smaller size (tests/protocol). CHECK_ARGS passes options through, e.g. CHECK_ARGS="--faults 1".
check-protocol: $(STAMP)
	$(BIN)/python -m tests.protocol.checker --size large $(CHECK_ARGS)
	$(BIN)/python -m tests.protocol.checker --size tiny --events die,error --faults 2

# Every scenario on torchheal (must pass), then on the reference (its crash is reported, not
# failed), then both as one table. The exit status is torchheal's.
torchtitan:
	PY=$(PY) bash examples/torchtitan/setup_venvs.sh all
	status=0; \
	.venv-titan/bin/python examples/torchtitan/run_scenarios.py --venv .venv-titan || status=$$?; \
	.venv-titan/bin/python examples/torchtitan/run_scenarios.py --venv .venv-titan-ref \
		--expect_crash || status=$$?; \
	.venv-titan/bin/python examples/torchtitan/run_scenarios.py \
		--table .venv-titan .venv-titan-ref; \
	exit $$status

clean:
	rm -rf $(VENV) build *.egg-info
