#!/usr/bin/env bash
# Creates the two virtualenvs of the torchtitan example (each ~2.4 GB, both git-ignored):
#
#   .venv-titan      torchtitan 0.3.0 on torchheal, with compat/ installed so `import torchft` is
#                    torchheal (the way a torchtitan user would run it)
#   .venv-titan-ref  torchtitan 0.3.0 on the real reference (torchft-nightly), for the side-by-side
#
# Usage: examples/torchtitan/setup_venvs.sh [titan|ref|all]   (default: all)
#
# Idempotent: a venv whose stamp matches this script's pins is left alone. torch==2.13.0 is
# installed first in each venv and passed to every later pip call as a constraint, so nothing
# can swap it for a CUDA build. torchtitan's own requirements are installed by name rather than
# resolved from its metadata: it asks for packages a CPU run never needs (wandb) and pins
# spmd_types, which would otherwise upgrade torch.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
WHICH=${1:-all}

TORCH="torch==2.13.0"
TORCHTITAN="torchtitan==0.3.0"
REFERENCE="torchft-nightly==2026.10.26"
# What torchtitan 0.3.0 imports on the code path we run (with its resolved dependencies).
TITAN_DEPS=(tyro einops safetensors "tokenizers>=0.15" tensorboard "datasets>=3.6,<4.8" pillow)
# Installed without their dependencies: each would otherwise pull or pin another torch.
# triton: torchtitan imports it unconditionally (blocker B1); 3.9.0 imports without a GPU.
TITAN_NODEPS=("spmd_types==0.2.3" "torchdata==0.11.0" "torch_checkpointing==0.1.1" "triton==3.9.0")
STAMP_TEXT="$TORCH $TORCHTITAN ${TITAN_DEPS[*]} ${TITAN_NODEPS[*]} v2"

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$TORCH" >"$constraints"

base_venv() {  # $1 = venv dir: python, pip, torch, torchtitan and its dependencies
  local venv=$1
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "$TORCH"
  "${pip[@]}" -c "$constraints" --no-deps "$TORCHTITAN" "${TITAN_NODEPS[@]}"
  "${pip[@]}" -c "$constraints" "${TITAN_DEPS[@]}"
}

stamp_ok() {  # $1 = venv dir, $2 = extra stamp text
  [ -f "$1/.torchtitan-example" ] && [ "$(cat "$1/.torchtitan-example")" = "$STAMP_TEXT $2" ]
}

setup_titan() {
  local venv=.venv-titan
  if stamp_ok "$venv" heal; then
    # torchheal and compat/ are editable installs: source changes need no reinstall.
    return 0
  fi
  echo "setting up $venv (torchtitan on torchheal)..."
  base_venv "$venv"
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$constraints")
  # The metrics extra: `torchheal lighthouse` serves its dashboard's Prometheus page.
  "${pip[@]}" -e ".[metrics]"
  "${pip[@]}" -e compat
  echo "$STAMP_TEXT heal" >"$venv/.torchtitan-example"
}

setup_ref() {
  local venv=.venv-titan-ref
  if stamp_ok "$venv" ref; then
    return 0
  fi
  echo "setting up $venv (torchtitan on the reference, $REFERENCE)..."
  base_venv "$venv"
  # The reference with --no-deps (its torch requirement would resolve to a CUDA build), then
  # what its import needs, pinned: scripts/install_reference.py does exactly that.
  "$venv/bin/python" scripts/install_reference.py
  echo "$STAMP_TEXT ref" >"$venv/.torchtitan-example"
}

case "$WHICH" in
  titan) setup_titan ;;
  ref) setup_ref ;;
  all) setup_titan; setup_ref ;;
  *) echo "usage: $0 [titan|ref|all]" >&2; exit 2 ;;
esac
