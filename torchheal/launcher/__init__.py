"""Running replica groups on one machine: the local launcher, its line protocol, the demo.

* ``local.py`` — :class:`Launcher` starts N replica-group processes (and a lighthouse), reads
  their output, injects failures and restarts the dead; ``records.py`` — what it is told
  (:class:`KillPlan`) and what it records (each group's history, the :class:`RunResult`).
* ``group.py`` — one start of a group: its store, torchrun's variables, its ranks.
* ``spare.py`` / ``spare_child.py`` — warm spares: processes that imported torch ahead of a
  restart (at idle priority) and are handed a rank's argv and environment; ``spare_command.py``
  (which ranks a spare can become), ``spare_process.py`` (a spare's process and ready line);
  ``spare_template.py`` / ``spare_fork.py`` — on Linux, spares forked from one template that
  imported once, so that refilling the pool after a restart costs no imports.
* ``proctree.py``, ``progress.py``, ``lighthouse.py`` — ending a group's processes, the progress
  line and report, a lighthouse and dashboard in process.
* ``events.py`` — the one-line-per-event protocol (``@torchheal {...}``) workers print and the
  launcher parses.
* ``demo/`` — ``torchheal demo``: a worker that speaks the protocol, the run and its summary.

Imports flow one way: ``demo`` uses ``local`` and ``events``; ``local`` uses the modules beside it, never ``demo``.
"""

from __future__ import annotations

from torchheal.launcher.local import Launcher, python_module_command
from torchheal.launcher.records import KillPlan, RunResult

__all__ = ["KillPlan", "Launcher", "RunResult", "python_module_command"]
