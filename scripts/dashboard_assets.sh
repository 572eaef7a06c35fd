#!/usr/bin/env bash
# Fetches the dashboard's browser libraries, pinned by package-lock.json, from the npm registry
# and copies the files the page serves into static/vendor/ (git-ignored build output, shipped in
# the package). The page never loads anything from a CDN. Idempotent: a no-op when the vendor
# files match the lock file. Called by scripts/setup_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=torchheal/coordination/lighthouse/dashboard
VENDOR=$DIR/static/vendor
STAMP=$VENDOR/.package-lock.sha256
want=$(sha256sum "$DIR/package-lock.json" | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
  && [ -f "$VENDOR/uPlot.iife.min.js" ] && [ -f "$VENDOR/uPlot.min.css" ]; then
  exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "dashboard assets: installing npm (Debian package) to fetch the pinned chart library"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null
  else
    echo "dashboard assets: npm is missing and cannot be installed here; the dashboard will" \
      "run without charts (it says so on the page)" >&2
    exit 1
  fi
fi
npm ci --prefix "$DIR" --ignore-scripts --no-audit --no-fund --loglevel=error
mkdir -p "$VENDOR"
cp "$DIR/node_modules/uplot/dist/uPlot.iife.min.js" "$DIR/node_modules/uplot/dist/uPlot.min.css" "$VENDOR/"
cp "$DIR/node_modules/uplot/LICENSE" "$VENDOR/uPlot.LICENSE"
echo "$want" >"$STAMP"
echo "dashboard assets: uPlot $(node -p "require('./$DIR/node_modules/uplot/package.json').version" 2>/dev/null || echo '?') installed in $VENDOR"
