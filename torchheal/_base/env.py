"""The one place torchheal reads ``os.environ``, and the parsing every settings module shares.

Only :func:`source` touches the process environment (``tests/test_import_graph.py`` holds
this). Every reader in the settings modules takes an optional ``environ`` mapping in place of
``os.environ``, so tests need not patch it. A variable the reference also reads has a
``TORCHHEAL_*`` name that wins over the reference's ``TORCHFT_*``. Malformed values raise
:class:`ValueError` naming the variable, so a typo fails at start-up.

Unlike the reference, ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` is never written: torchheal bounds
NCCL operations with its own timer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["OFF", "lookup", "parse_int", "parse_port", "source"]

#: Values of an on/off variable that mean off (any case).
OFF = frozenset({"", "false", "0", "no", "off"})


def source(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    """The mapping to read: ``environ``, or this process's environment when None."""
    return os.environ if environ is None else environ


def lookup(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """``(variable name, stripped value)`` of the first of ``names`` set to a non-blank value."""
    for name in names:
        value = environ.get(name)
        if value is not None and value.strip() != "":
            return name, value.strip()
    return None


def parse_int(name: str, value: str, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``; the ValueError names the variable."""
    try:
        parsed = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
    if parsed < minimum:
        raise ValueError(f"{name}={value!r} must be >= {minimum}")
    return parsed


def parse_port(name: str, value: str) -> int:
    """``value`` as a TCP port (0: any free port); the ValueError names the variable."""
    port = parse_int(name, value, minimum=0)
    if port > 65535:
        raise ValueError(f"{name}={value!r} is not a valid port")
    return port
