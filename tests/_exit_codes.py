"""A rank that ends as told (light: spawned children import only this module)."""

from __future__ import annotations

import os
import signal
import sys


def end_as(incarnation: int, how: str) -> None:
    """The first incarnation SIGKILLs itself (``sigkill``) or exits 1 (``exit1``); later ones exit 0.

    Args:
        incarnation: which start of the group this is.
        how: ``sigkill``, ``exit1`` or ``clean``.
    """
    if incarnation == 0 and how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if incarnation == 0 and how == "exit1":
        sys.exit(1)
