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
pip install -q -e ".[test]"
# Bytecode for the editable source tree. pip compiles an installed wheel, but not an editable
# install; where PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile
# torchheal again at import (about 0.3 s of CPU per process, and the tests start hundreds).
# Python still reads these files, and it ignores one whose source has changed since.
"$VENV/bin/python" -m compileall -q -j 0 torchheal bench tests examples >/dev/null
# The dashboard's chart library, pinned by its package-lock.json, from the npm registry.
bash scripts/dashboard_assets.sh || echo "WARNING: dashboard assets not installed: the dashboard will run without charts"
# Headless Chromium and its WebDriver for the dashboard's browser test: Debian's packages,
# installed only when missing (so a second run costs nothing) and only where apt-get can run.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's chromium and chromium-driver for the dashboard browser test"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends chromium chromium-driver >/dev/null; } \
      || echo "WARNING: could not install chromium; the dashboard browser test will fail in CI"
  else
    echo "WARNING: chromium/chromedriver missing and not installable here (needs root and" \
      "apt-get): the dashboard browser test will be skipped, loudly"
  fi
fi
# etcd for the lighthouse's high-availability test (docs/lighthouse_ha.md): Debian's etcd-server,
# installed only when missing. Its test fails (never skips) without it, so CI must have it.
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian's etcd-server for the lighthouse high-availability test"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends etcd-server >/dev/null; } \
      || { echo "ERROR: could not install etcd-server (the HA test needs it)" >&2; exit 1; }
  else
    echo "WARNING: etcd missing and not installable here (needs root and apt-get): the" \
      "lighthouse high-availability test will fail until etcd is on PATH"
  fi
fi
# The reference implementation, used only by interop tests and benchmarks (never imported by
# torchheal itself). In CI (CI set, as .ci/run does) a failed install stops the set-up: the
# interop tests must run there. A developer offline gets a clear note, and the interop tests
# skip loudly (tests/reference.py) until the next set-up with network.
if ! "$VENV/bin/python" scripts/install_reference.py; then
  if [ -n "${CI:-}" ]; then
    echo "ERROR: the reference (torchft-nightly) could not be installed, and CI needs it for the" \
      "interop tests; see the pip output above" >&2
    exit 1
  fi
  echo "NOTE: the reference (torchft-nightly) is not installed (offline?): the interop tests" \
    "will be skipped, with a warning, until scripts/setup_env.sh runs again with network"
fi
# Names for the IPv6 loopback addresses. c10d's TCPStore looks up the name of every connection's
# peer, on both sides (torch/csrc/distributed/c10d/socket.cpp, formatSockAddr), and its sockets
# are IPv6: a loopback peer is ::ffff:127.0.0.1 or ::1. Where /etc/hosts has no name for those,
# each lookup goes to DNS, and a query the DNS server drops holds the store for the resolver's
# 5 s timeout: on the CI machine, 7 client connections in 200 to a local store took 5 s (0 in
# 400 with the names). In CI (and only there) the names are added; elsewhere this says how.
if ! grep -qE '^[[:space:]]*::ffff:127\.0\.0\.1[[:space:]]' /etc/hosts 2>/dev/null; then
  if [ -n "${CI:-}" ] && [ "$(id -u)" = 0 ] && [ -w /etc/hosts ]; then
    echo "naming the IPv6 loopback addresses in /etc/hosts (c10d looks up every peer's name)"
    # Names of their own: "localhost" keeps resolving to 127.0.0.1 alone, as before.
    grep -qE '^[[:space:]]*::1[[:space:]]' /etc/hosts || echo "::1 ip6-localhost ip6-loopback" >>/etc/hosts
    echo "::ffff:127.0.0.1 ip4-mapped-localhost" >>/etc/hosts
  else
    echo "NOTE: /etc/hosts has no name for ::ffff:127.0.0.1, so c10d's store connections over" \
      "loopback ask DNS for one; where DNS drops queries, a connection can take 5 s more. To" \
      "add it: echo '::ffff:127.0.0.1 ip4-mapped-localhost' | sudo tee -a /etc/hosts"
  fi
fi
