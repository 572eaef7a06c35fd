"""A warm spare's process: started fresh or forked from a template, and its ready line.

A fresh spare writes one JSON line on a pipe once it has preloaded; a forked one is ready from
its start. Either is a :class:`subprocess.Popen` that is the rank's own once handed over.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from torchheal.launcher.spare_fork import ForkedSpare

__all__ = [
    "ForkedSpareProcess",
    "SpareProcess",
    "close_ready",
    "leftover",
    "read_ready",
    "start_fresh",
    "started_warm",
]

_CHILD = "torchheal.launcher.spare_child"


class SpareProcess(subprocess.Popen):  # type: ignore[type-arg]
    """A spare's process: a :class:`subprocess.Popen` that is the rank once handed over.

    Attributes:
        ready: it finished its preloading (as far as the pool has seen).
        handed_over: when it was handed a rank's identity (None while idle).
        ready_at_handover: it had finished preloading when it was handed over.
    """

    ready: bool = False
    handed_over: float | None = None
    ready_at_handover: bool = False
    ready_fd: int | None = None
    missing: tuple[str, ...] = ()


class ForkedSpareProcess(ForkedSpare, SpareProcess):
    """A spare forked from the pool's template (``spare_fork.py``): ready from its start."""

    ready = True


def start_fresh(
    interpreter: Sequence[str],
    preload: Sequence[str],
    env: Mapping[str, str],
    cwd: str | None,
    popen: Mapping[str, Any],
) -> SpareProcess:
    """Starts a spare as a fresh interpreter that imports ``preload``, then waits for a rank
    (``popen``: the pool's pipes and session setting, as :class:`subprocess.Popen` arguments)."""
    read_fd, write_fd = os.pipe()
    argv = [*interpreter, "-m", _CHILD, "--ready-fd", str(write_fd)]
    for module in preload:
        argv += ["--preload", module]
    try:
        spare = SpareProcess(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
            **popen,
        )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    spare.ready_fd = read_fd
    return spare


def read_ready(spare: SpareProcess, timeout: float = 0.0) -> bool:
    """Reads a fresh spare's ready line if it is there (waiting up to ``timeout``).

    True only when this call read a line saying the spare is ready (one that died or wrote
    garbage is dropped when seen dead).
    """
    if spare.ready or spare.ready_fd is None:
        return False
    readable, _, _ = select.select([spare.ready_fd], [], [], timeout)
    if not readable:
        return False
    data = os.read(spare.ready_fd, 65536)
    os.close(spare.ready_fd)
    spare.ready_fd = None
    try:
        ready = json.loads(data)
        spare.ready = bool(ready.get("ready"))
        spare.missing = tuple(str(m) for m in ready.get("missing", ()))
    except (ValueError, AttributeError):
        spare.ready = False
    return spare.ready


def close_ready(spare: SpareProcess) -> None:
    """Closes the spare's ready pipe if it is still open (its line no longer matters)."""
    if spare.ready_fd is not None:
        os.close(spare.ready_fd)
        spare.ready_fd = None


def started_warm(proc: subprocess.Popen[str]) -> bool:
    """Whether a process :meth:`SparePool.spawn` returned began as a warm spare."""
    return isinstance(proc, SpareProcess) and proc.handed_over is not None


def leftover(spare: SpareProcess) -> str:
    """What a dead spare printed (its stdout, when the pool reads it), cut to 2000 characters."""
    if spare.stdout is None:
        return ""
    try:
        return spare.stdout.read()[-2000:].strip()
    except (OSError, ValueError):
        return ""
