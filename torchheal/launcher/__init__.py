"""Running replica groups on one machine: the local launcher, its line protocol, the demo.

* ``local.py`` — :class:`Launcher` runs the groups, injects failures and restarts the dead;
  ``records.py`` — its :class:`KillPlan` and :class:`RunResult`; ``group.py`` — one start.
* ``spare*.py`` — warm spares: processes that imported torch ahead of a restart.
* ``proctree.py``, ``progress.py``, ``lighthouse.py`` — ending a group's processes, the progress
  line and report, a lighthouse and dashboard in process.
* ``events.py`` — the ``@torchheal {...}`` lines workers print; ``demo/`` — ``torchheal demo``.

Imports flow one way: ``demo`` uses ``local`` and ``events``; ``local`` uses the modules beside it, never ``demo``.
"""

from __future__ import annotations

from torchheal.launcher.local import Launcher, python_module_command
from torchheal.launcher.records import KillPlan, RunResult

__all__ = ["KillPlan", "Launcher", "RunResult", "python_module_command"]
