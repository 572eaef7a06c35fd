"""What a client can make the dashboard hold: connections, a request's head, and its time.

The read-only pages need no token, so anyone who reaches the port is such a client. The tests
shrink the limits (``server.HttpLimits``), then read the server's answer from the client's side:
the oldest connection once the cap is full, or one whose request never completes, sees the
server close it; a head with too many lines is answered 400; a normal page is still served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest

from tests.dashboard.helpers import get_json, lighthouse_with_dashboard, wait_until
from tests.raw_client import RawClient
from torchheal.coordination.lighthouse.dashboard import server as dashboard_server


class Client(RawClient):
    """A raw connection to the dashboard."""


@pytest.fixture
def dashboard(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., AbstractContextManager[Any]]]:
    """``dashboard(**limits)``: a lighthouse with a dashboard whose limits are those given."""

    def run(**limits: Any) -> AbstractContextManager[Any]:
        # Not raising: a dashboard from before the limits runs the test too, and fails it.
        value = dashboard_server.HttpLimits(**limits)
        monkeypatch.setattr(dashboard_server, "LIMITS", value, raising=False)
        return lighthouse_with_dashboard()

    yield run


def test_the_oldest_connections_make_room_and_pages_are_still_served(dashboard: Any) -> None:
    # An idle time far off, so that nothing but the cap can close a connection in the test.
    with dashboard(connections=4, idle_s=300.0) as (_, dash, url):
        idle = [Client(dash.port) for _ in range(4)]
        extra = [Client(dash.port) for _ in range(3)]  # accepted in order: each closes the oldest
        wait_until(lambda: all(c.ended() for c in idle[:3]), 10, "the oldest to make room")
        assert not any(c.ended() for c in [idle[3], *extra])  # the cap is full, not over
        # Slow clients fill the cap, and a page is served all the same.
        assert "quorum" in get_json(url + "api/status")
        wait_until(idle[3].ended, 10, "the oldest to make room for the page")
        for c in [*idle, *extra]:
            c.close()


def test_a_request_that_never_completes_is_closed_and_a_long_head_refused(
    dashboard: Any,
) -> None:
    with dashboard(idle_s=1.0, header_lines=8) as (_, dash, url):
        # A slow client: a few lines of its head, never the blank line that ends it.
        slow = Client(dash.port, b"GET /api/status HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 8000)
        idle = Client(dash.port)
        # Within its time, a page is served to others.
        assert "quorum" in get_json(url + "api/status")
        wait_until(lambda: slow.ended() and idle.ended(), 10, "the server to close slow clients")
        assert slow.received == b""  # closed, not answered
        many = b"".join(b"X-%d: v\r\n" % i for i in range(9))
        long_head = Client(dash.port, b"GET / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
        wait_until(long_head.ended, 10, "the server to answer a head of too many lines")
        assert long_head.received.split(b" ")[1] == b"400", long_head.received[:200]
        for c in (slow, idle, long_head):
            c.close()
