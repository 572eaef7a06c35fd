"""A warm spare's CPU priority: idle while it preloads, normal from the hand-over on.

A spare (or template) imports at Linux ``SCHED_IDLE`` priority, taking only CPU nobody else
wants, where it may take its normal priority back; elsewhere the preload runs at normal priority.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading

__all__ = ["Priority", "can_preload_idle", "may_leave_idle"]


def may_leave_idle() -> bool:
    """Whether a thread of this process that goes ``SCHED_IDLE`` may take ``SCHED_OTHER`` back.

    It needs ``CAP_SYS_NICE`` or a non-default ``RLIMIT_NICE``. Probed on a throwaway thread:
    the policy is per thread, and a failed probe would leave the caller idle for good.
    """
    answer: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            answer.append(True)
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=probe, name="spare-idle-probe")
    thread.start()
    thread.join()
    return answer == [True]


def can_preload_idle() -> bool:
    """Whether a spare preloads at idle priority here: Linux, and :func:`may_leave_idle`."""
    return hasattr(os, "SCHED_IDLE") and may_leave_idle()


class Priority:
    """The preload's idle priority, and giving it back (see the module docstring)."""

    def __init__(self) -> None:
        self.idle = False
        self._decided = threading.Event()

    @classmethod
    def inherited(cls, idle: bool) -> Priority:
        """The priority of a fork of a template whose preload went ``idle`` (a fork keeps the
        forking thread's policy)."""
        priority = cls()
        priority.idle = idle
        priority._decided.set()
        return priority

    def idle_while_preloading(self) -> None:
        """Switches this thread to ``SCHED_IDLE`` if it may switch back later."""
        try:
            if can_preload_idle():
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                self.idle = True
        except OSError:
            pass  # the preload runs at normal priority
        finally:
            self._decided.set()

    def normal(self) -> None:
        """Every thread of this process back to ``SCHED_OTHER``, if the preload went idle
        (threads started during the preload inherited ``SCHED_IDLE``)."""
        self._decided.wait()
        if not self.idle:
            return
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tids = [0]
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))

    def normal_on_handover(self) -> None:
        """Starts a thread (before the switch to idle, so at normal priority) that waits until
        stdin is readable, a hand-over or the pool's end, then calls :meth:`normal`."""

        def watch() -> None:
            with contextlib.suppress(OSError, ValueError):
                select.select([0], [], [])
            self.normal()

        threading.Thread(target=watch, name="spare-handover", daemon=True).start()
