"""``torchft`` served by torchheal (the opt-in ``torchheal-as-torchft`` distribution).

Programs that find the reference by its import name (torchtitan checks
``importlib.util.find_spec("torchft")``) run on torchheal unchanged: ``torchft.Manager`` *is*
``torchheal.Manager`` and ``import torchft.process_group`` gives the module
``torchheal.process_group`` itself. Any ``torchft.<path>`` resolves to ``torchheal.<path>``.

Installing this next to the real torchft (``torchft`` or ``torchft-nightly``) is refused at
import: both distributions own the ``torchft`` package directory, so files of one would shadow
or overwrite the other's.
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib import metadata
from typing import Any

from torchft import _alias

# Distribution names of the real reference.
REFERENCE_DISTRIBUTIONS = ("torchft", "torchft-nightly")


def _installed_references() -> list[str]:
    found = []
    for name in REFERENCE_DISTRIBUTIONS:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return found


_conflicts = _installed_references()
if _conflicts:
    raise ImportError(
        "torchheal-as-torchft provides the `torchft` import name, but the real torchft is also "
        f"installed here ({', '.join(_conflicts)}); the two must never share an environment. "
        "Uninstall one of them: `pip uninstall torchheal-as-torchft` to use the reference, or "
        f"`pip uninstall {' '.join(c.split()[0] for c in _conflicts)}` (then reinstall "
        "torchheal-as-torchft) to use torchheal."
    )

import torchheal  # noqa: E402  (after the guard: a clear error beats a half-mixed import)

_alias.install("torchft", "torchheal")

__all__ = list(torchheal.__all__)


def __getattr__(name: str) -> Any:
    # Top-level names (Manager, ProcessGroupGloo, ...) are torchheal's, resolved lazily as there.
    try:
        return getattr(torchheal, name)
    except AttributeError:
        pass
    # The reference imports its submodules eagerly, so `import torchft` then
    # `torchft.process_group.X` works there (torchtitan relies on it): import on first access.
    if importlib.util.find_spec(f"torchheal.{name}") is None:
        raise AttributeError(f"module 'torchft' has no attribute {name!r}")
    return importlib.import_module(f"torchft.{name}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(dir(torchheal)))
