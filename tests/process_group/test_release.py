"""An aborted Gloo group is released off the aborting thread (except at shutdown).

Gloo's destructor joins its worker threads, and a worker blocked in a receive whose peers
closed their connections is not always woken (a group woken from a freeze: 3 of 6 runs of a
two-process script waited out the operation's timeout, its own cut notwithstanding), while its
abort returns at once. Dropped on the aborting thread, the group held that thread (a lighthouse
notice's, or the quorum thread's rebuild) until the operation's timeout.

The inner group here is a stand-in whose release waits until the test lets it go: the state of
such a group, which no real one reaches on demand. What is under test is the wrapper's abort.
"""

from __future__ import annotations

import threading

from torchheal.process_group.gloo import ProcessGroupGloo

BOUND_S = 10.0


class _HeldInRelease:
    """Releases only when ``go`` is set; records the thread that released it."""

    def __init__(self, go: threading.Event, released: threading.Event, by: list[str]) -> None:
        self._go, self._released, self._by = go, released, by
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def __del__(self) -> None:
        self._go.wait(BOUND_S)
        self._by.append(threading.current_thread().name)
        self._released.set()


def _held(pg: ProcessGroupGloo) -> tuple[threading.Event, threading.Event, list[str]]:
    go, released, by = threading.Event(), threading.Event(), []
    pg._pg = _HeldInRelease(go, released, by)  # type: ignore[assignment]
    return go, released, by


def test_an_abort_returns_while_the_group_it_dropped_is_still_being_released() -> None:
    pg = ProcessGroupGloo()
    go, released, by = _held(pg)
    inner = pg._pg
    assert isinstance(inner, _HeldInRelease)
    del inner
    aborter = threading.Thread(target=pg.abort, name="notice")
    aborter.start()
    aborter.join(BOUND_S / 2)
    assert not aborter.is_alive(), "the abort waited for the group's release"
    assert not released.is_set() and pg._pg is None
    go.set()
    assert released.wait(BOUND_S)
    assert by == ["torchheal-release-pg"]


def test_shutdown_releases_the_group_on_its_own_thread() -> None:
    # The process may end right after: a release still running elsewhere would race its end.
    pg = ProcessGroupGloo()
    go, released, by = _held(pg)
    go.set()
    pg.shutdown()
    assert released.is_set() and by == [threading.current_thread().name]
