"""Install the reference implementation (torchft-nightly) next to torchheal, for interop tests.

The reference is used only by ``tests/interop`` and ``bench/``; torchheal never imports it.

What ``import torchft.coordination`` needs (found by importing it): ``torchft/__init__.py``
imports ``torchft.otel``, which imports the OpenTelemetry API, SDK *and* the OTLP/HTTP log
exporter at module level, so all three are required even though nothing is ever exported. The
exporter pulls ``opentelemetry-proto`` (``protobuf>=5,<8``), ``googleapis-common-protos``
(``protobuf>=6.33.5,<8``) and ``requests``; none of them asks for a different torch, grpcio or
protobuf than ours (checked with ``pip install --dry-run``), so the whole set is installed and
``pip check`` stays clean.

Guarantees:
* the reference itself goes in with ``--no-deps`` (its ``torch`` requirement would otherwise be
  resolved against PyPI's CUDA build);
* everything else is pinned, and the installed torch, protobuf and grpcio are passed to pip as
  constraints, so pip fails rather than upgrading or downgrading them;
* when the pinned reference already imports, nothing is run (a second call is instant).

Exits 0 when ``import torchft.coordination`` works afterwards, 1 otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from importlib import metadata

REFERENCE = "torchft-nightly==2026.10.26"

# Exactly what the reference's import needs, with its transitive dependencies, pinned to the
# versions verified together with torch 2.13 / protobuf 7 / grpcio 1.85.
IMPORT_DEPS = (
    "opentelemetry-api==1.45.2",
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2",
    "opentelemetry-exporter-otlp-proto-http==1.45.2",
    "opentelemetry-exporter-otlp-proto-common==1.45.2",
    "opentelemetry-exporter-otlp-common==0.66b2",
    "opentelemetry-exporter-http-transport[requests]==0.66b2",
    "opentelemetry-proto==1.45.2",
    "googleapis-common-protos==1.76.0",
    "requests==2.34.2",
    "urllib3==2.8.0",
    "idna==3.20",
    "certifi==2026.10.18",
    "charset-normalizer==3.5.2",
)

# Ours: pip must never change these to satisfy the reference.
PROTECTED = ("torch", "protobuf", "grpcio")

CHECK = "import torchft.coordination"


def _reference_imports() -> bool:
    """True when the pinned reference is installed and its coordination module imports."""
    try:
        if metadata.version("torchft-nightly") != REFERENCE.split("==")[1]:
            return False
    except metadata.PackageNotFoundError:
        return False
    # A fresh interpreter: this process may have a stale import state after installing.
    return subprocess.run([sys.executable, "-c", CHECK], capture_output=True).returncode == 0


def _constraints() -> str:
    """Pins of the protected packages as currently installed, one per line."""
    lines = []
    for name in PROTECTED:
        try:
            lines.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return "\n".join(lines) + "\n"


def main() -> int:
    """Install the reference and its import dependencies; 0 when it imports afterwards."""
    if _reference_imports():
        return 0
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(_constraints())
        constraints = f.name
    try:
        subprocess.run([*pip, "--no-deps", REFERENCE], check=True)
        subprocess.run([*pip, "-c", constraints, *IMPORT_DEPS], check=True)
    except subprocess.CalledProcessError as e:
        print(f"could not install {REFERENCE} and its import dependencies: {e}", file=sys.stderr)
        return 1
    finally:
        os.unlink(constraints)
    if not _reference_imports():
        print(f"{REFERENCE} installed but `{CHECK}` fails", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
