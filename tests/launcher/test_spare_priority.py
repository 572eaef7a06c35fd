"""A warm spare's idle priority for its imports, as a user without ``CAP_SYS_NICE`` gets it.

Linux lets a thread leave ``SCHED_IDLE`` only with ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that
allows its nice value; the default limit is 0, so most users cannot. A spare that went idle
there would run its rank at idle priority for good, starving whenever the machine is busy. The
checks run in a forked child that takes the usual user's limits: ``RLIMIT_NICE`` 0 and, when the
suite runs as root, the ``nobody`` user (no capabilities).
"""

from __future__ import annotations

import json
import os
import resource
import threading

import pytest

from torchheal.launcher.spare_priority import Priority, may_leave_idle

NOBODY = 65534

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling only")


def _as_unprivileged_user() -> dict[str, object]:
    """In a forked child without the right to leave ``SCHED_IDLE``: what the spare's
    priority handling does. Returns the child's findings."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os calls and one short thread, then _exit
        code = 1
        try:
            os.close(r)
            resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)  # drops every capability
            found: dict[str, object] = {"may_leave_idle": may_leave_idle()}
            found["policy_after_probe"] = os.sched_getscheduler(0)
            priority = Priority()
            priority.idle_while_preloading()
            found["idle"] = priority.idle
            found["policy_preloading"] = os.sched_getscheduler(0)
            priority.normal()
            found["policy_as_rank"] = os.sched_getscheduler(0)
            os.write(w, json.dumps(found).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as out:
        data = out.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    return json.loads(data)


def test_an_unprivileged_spare_preloads_at_normal_priority_instead_of_idle_for_good() -> None:
    found = _as_unprivileged_user()
    assert found["may_leave_idle"] is False, found  # the premise: this user cannot come back
    # Neither the probe nor the preload left the thread idle ...
    assert found["policy_after_probe"] == os.SCHED_OTHER, found
    assert found["idle"] is False and found["policy_preloading"] == os.SCHED_OTHER, found
    # ... so the rank it becomes runs at normal priority.
    assert found["policy_as_rank"] == os.SCHED_OTHER, found


def test_a_spare_goes_idle_exactly_when_it_may_come_back_and_its_rank_runs_normal() -> None:
    may = may_leave_idle()
    if os.geteuid() == 0:
        assert may, "root may always leave SCHED_IDLE"
    priority = Priority()
    policies: list[int] = []

    def spare() -> None:  # a thread of its own: the test's thread keeps its policy
        priority.idle_while_preloading()
        policies.append(os.sched_getscheduler(0))
        priority.normal()
        policies.append(os.sched_getscheduler(0))

    thread = threading.Thread(target=spare)
    thread.start()
    thread.join()
    assert priority.idle is may
    assert policies == [os.SCHED_IDLE if may else os.SCHED_OTHER, os.SCHED_OTHER]
