"""The reference implementation (torchft-nightly) for interop tests: present, or a loud absence.

``scripts/setup_env.sh`` installs it. A developer offline may run the suite without it: the
interop tests are then skipped with a warning that says so. In CI (``CI`` is set, as
``.ci/run`` does) a missing reference fails the run instead, so interop can never be skipped
silently there.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from types import ModuleType

import pytest


def missing_reference(why: str) -> None:
    """Fails in CI, otherwise skips loudly (a warning and a line on stderr).

    Args:
        why: what is missing, for the message.
    """
    message = (
        f"!!! INTEROP TESTS NOT RUN: {why}. scripts/setup_env.sh installs the reference "
        "(torchft-nightly, needs network once). !!!"
    )
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    warnings.warn(message, stacklevel=2)
    print(message, file=sys.stderr)
    pytest.skip(message, allow_module_level=True)


def import_reference(module: str = "torchft.coordination") -> ModuleType:
    """Imports a reference module, or fails (CI) / skips loudly (elsewhere).

    Args:
        module: the module to import.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing_reference(f"cannot import {module} ({e})")
        raise  # unreachable: missing_reference always raises
