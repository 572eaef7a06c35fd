#!/usr/bin/env bash
# Creates the virtualenv and installs torchheal with its test tools.
# torch is installed first and pinned to the CPU build unless the venv already has one:
# a bare `torch` requirement would otherwise pull a multi-gigabyte CUDA build.
set -euo pipefail
PY=${PY:-python3}
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
"$VENV/bin/python" -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
pip install -q -e ".[test,metrics]"
# The reference implementation, used only by interop tests and benchmarks (never imported by
# torchheal itself). Optional: tests that need it skip when it cannot be installed.
"$VENV/bin/python" scripts/install_reference.py || echo "note: reference (torchft-nightly) not installed; interop tests will skip"
