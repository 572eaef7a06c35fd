"""Ending a replica group: every process it started, wherever it went.

A rank's process may start others (a shell script, torchrun and its workers, data loader
workers), and some of them leave its session (torchrun starts each worker in a session of its
own), so neither killing the pid nor its process group is enough; and a process whose parent
died is adopted by init, so it is no longer anyone's descendant. On Linux the launcher therefore
finds a group's processes two ways, in ``/proc``: the descendants of its ranks, and every
process whose environment carries the group start's marker variable (inherited by whatever the
ranks start). It stops them all with SIGSTOP (a stopped process cannot fork a child we would
miss), looks again until no new one appears, then SIGKILLs the lot. Elsewhere it falls back to
the pids and their own process groups.
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
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after
        # the last ")".
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) < 2:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def descendants(pids: Iterable[int]) -> set[int]:
    """Every live descendant of ``pids`` (not the pids themselves), from ``/proc``.

    Args:
        pids: the roots.

    Returns:
        The descendants' pids; empty where ``/proc`` does not exist.
    """
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
    """Live processes (of this user) started with ``name=value`` in their environment.

    Args:
        name: the variable.
        value: its value.

    Returns:
        Their pids, never this process's; empty where ``/proc`` does not exist.
    """
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
    """SIGKILL ``pids`` and every process they started, in any session.

    Args:
        pids: the roots (processes this launcher started; they must not be reaped yet, so
            their pids still name them).
        marker: ``(variable, value)`` every process of the group inherited: finds those that
            init adopted after their parent died.
        rounds: how many times to look for processes that appeared while stopping the others.

    Returns:
        Every pid that was signalled.
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
