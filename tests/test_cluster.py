"""The shared harness tells a planned SIGKILL from any other death (tests/cluster.py)."""

from __future__ import annotations

import pytest

from tests._exit_codes import end_as
from tests.cluster import Launch, supervise


def _run(how: str, planned_kills: int) -> dict[int, int]:
    return supervise(
        lambda group, rank, incarnation, port: (end_as, (incarnation, how)),
        [Launch(0, ranks=2, planned_kills=planned_kills)],
        deadline_s=60,
    )


def test_a_planned_sigkill_restarts_the_group() -> None:
    assert _run("sigkill", planned_kills=1) == {0: 1}


def test_a_crash_is_not_taken_for_the_planned_kill() -> None:
    with pytest.raises(AssertionError, match=r"exit codes \{\d: 1.*planned SIGKILL expected"):
        _run("exit1", planned_kills=1)


def test_an_unplanned_sigkill_fails_the_run() -> None:
    with pytest.raises(AssertionError, match="no kill was planned"):
        _run("sigkill", planned_kills=0)
