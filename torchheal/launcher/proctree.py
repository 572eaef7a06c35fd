"""Ending a replica group: every process it started, wherever it went.

A rank's children may leave its session (torchrun's workers do) or be adopted by init when
their parent dies, so neither the pid nor its process group is enough. On Linux the group's
processes are found in ``/proc`` as the ranks' descendants plus every process carrying the
start's marker variable; they are SIGSTOPped (a stopped process cannot fork one we would miss)
until no new one appears, then SIGKILLed. Elsewhere: the pids and their own process groups.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

__all__ = ["descendants", "kill_trees", "marked"]

_PROC = Path("/proc")


def _parents() -> dict[int, list[int]]:
    """ppid -> [pid] for every process visible in ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it ended while we looked
        # "pid (comm) state ppid ...": comm may hold spaces and ")", so split after the last.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) < 2:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(pids: Iterable[int]) -> set[int]:
    """Every live descendant of ``pids`` (not the pids themselves); empty without ``/proc``."""
    if not _PROC.is_dir():
        return set()
    children = _parents()
    found: set[int] = set()
    stack = list(pids)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def marked(name: str, value: str) -> set[int]:
    """Pids of live processes (this user's, not this one) with ``name=value`` in their
    environment; empty without ``/proc``."""
    if not _PROC.is_dir():
        return set()
    wanted = f"{name}={value}".encode()
    own = os.getpid()
    found = set()
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # ended, or someone else's
        if wanted in environ.split(b"\0"):
            found.add(int(entry.name))
    return found


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_trees(
    pids: Iterable[int], marker: tuple[str, str] | None = None, rounds: int = 20
) -> set[int]:
    """SIGKILL ``pids`` and every process they started, in any session; returns the pids
    signalled.

    Args:
        pids: the roots, not reaped yet (so their pids still name them).
        marker: ``(variable, value)`` every process of the group inherited.
        rounds: how many times to look for processes that appeared while stopping the others.
    """
    roots = [p for p in pids if p > 0]
    if not _PROC.is_dir():
        for pid in roots:
            _kill_own_group(pid)
            _signal(pid, signal.SIGKILL)
        return set(roots)
    stopped: set[int] = set()
    for pid in roots:
        if _signal(pid, signal.SIGSTOP):
            stopped.add(pid)
    for _ in range(rounds):
        found = descendants([*roots, *stopped])
        if marker is not None:
            found |= marked(*marker)
        new = found - stopped
        if not new:
            break
        for pid in new:
            if _signal(pid, signal.SIGSTOP):
                stopped.add(pid)
    for pid in stopped | set(roots):
        _signal(pid, signal.SIGKILL)
    return stopped | set(roots)


def _kill_own_group(pid: int) -> None:
    """Without ``/proc``: a root that leads its own process group takes that group with it."""
    with contextlib.suppress(OSError):
        if os.getpgid(pid) == pid and pid != os.getpgrp():
            os.killpg(pid, signal.SIGKILL)
