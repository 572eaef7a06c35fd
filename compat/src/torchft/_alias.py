"""Serve one package's import name from another package's modules (``torchft`` -> ``torchheal``).

:func:`install` adds a finder at the end of ``sys.meta_path``: ``import {alias}.x.y`` imports
``{target}.x.y`` and binds the *same module object* under both names, so classes, module state
and ``isinstance`` checks are shared (there is one ``Manager`` class, not two copies). Modules
that physically live in the alias package itself are found first by the normal path finder,
because this finder comes last.

This module imports nothing from either package, so it can be loaded on its own (the tests
load it by file path under a made-up alias).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

__all__ = ["install"]


class _AliasLoader(importlib.abc.Loader):
    """Loads ``{alias}.x`` by importing ``{target}.x`` and putting that module in its place."""

    def __init__(self, target_name: str) -> None:
        self._target_name = target_name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a throwaway placeholder; exec_module swaps in the real module

    def exec_module(self, module: ModuleType) -> None:
        # The import system re-reads sys.modules after exec_module, so the caller (and the
        # parent package's attribute) get the target module, not the placeholder.
        sys.modules[module.__name__] = importlib.import_module(self._target_name)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``{alias}.x.y`` as ``{target}.x.y``."""

    def __init__(self, alias: str, target: str) -> None:
        self.alias = alias
        self.target = target

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.alias + "."):
            return None
        target_name = self.target + fullname[len(self.alias) :]
        try:
            found = importlib.util.find_spec(target_name)
        except ModuleNotFoundError:
            found = None  # a missing parent: the usual "No module named" error follows
        if found is None:
            return None
        return importlib.util.spec_from_loader(
            fullname,
            _AliasLoader(target_name),
            is_package=found.submodule_search_locations is not None,
        )


def install(alias: str, target: str) -> None:
    """Makes ``import {alias}.<sub>`` return ``{target}.<sub>`` (idempotent).

    Args:
        alias: the import name served (``"torchft"``).
        target: the package whose modules serve it (``"torchheal"``).
    """
    for finder in sys.meta_path:
        if isinstance(finder, _AliasFinder) and finder.alias == alias:
            if finder.target != target:
                raise ImportError(f"{alias!r} is already an alias of {finder.target!r}")
            return
    sys.meta_path.append(_AliasFinder(alias, target))
