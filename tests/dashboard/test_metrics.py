"""The lighthouse's /metrics move with real traffic (real LighthouseServer, real clients)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from tests.dashboard.helpers import Background, lighthouse_with_dashboard, scrape, wait_until
from torchheal.coordination import LighthouseClient
from torchheal.coordination.lighthouse.server import LighthouseServer
from torchheal.metrics.stats import Histogram

P = "torchheal_lighthouse_"
TIMEOUT = timedelta(seconds=10)


def test_counters_and_gauges_follow_quorum_rounds_heartbeats_and_a_lost_member() -> None:
    # Stragglers are waited for (join timeout 60 s) until their heartbeat expires (0.5 s).
    with lighthouse_with_dashboard(
        min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=500
    ) as (lh, _, url):
        before = scrape(url)
        assert before[P + "heartbeats_total"] == 0
        assert before[P + "quorum_rounds_total"] == 0
        assert before[P + "quorum_id"] == 0
        assert before[P + "min_replicas"] == 1
        assert before["process_cpu_seconds_total"] >= 0  # the process's own metrics too

        a = LighthouseClient(f"127.0.0.1:{lh.port()}", TIMEOUT)
        b = LighthouseClient(f"127.0.0.1:{lh.port()}", TIMEOUT)
        for _ in range(5):
            a.heartbeat("a")
            b.heartbeat("b")
        m = scrape(url)
        assert m[P + "heartbeats_total"] == 10
        assert m[P + "replicas_heartbeating"] == 2

        # a asks alone and waits for b, which is heartbeating: one request waiting.
        first = Background(lambda: a.quorum("a", timeout=TIMEOUT, step=7))
        wait_until(lambda: scrape(url)[P + "quorum_requests_waiting"] == 1, what="a waiting")
        assert scrape(url)[P + "quorum_rounds_total"] == 0
        q = b.quorum("b", timeout=TIMEOUT, step=7)
        assert first.join().quorum_id == q.quorum_id == 1
        m = scrape(url)
        assert m[P + "quorum_rounds_total"] == 1
        assert m[P + "quorum_requests_total"] == 2
        assert m[P + "quorum_requests_waiting"] == 0
        assert m[P + "quorum_id"] == 1
        assert m[P + "quorum_size"] == 2
        assert m[P + "max_step"] == 7
        assert m[P + "members_joined_total"] == 2
        assert m[P + "members_lost_total"] == 0
        assert m[P + "quorum_round_duration_seconds_count"] == 1
        assert m[P + 'quorum_round_duration_seconds_bucket{le="+Inf"}'] == 1
        assert m[P + "quorum_round_duration_seconds_sum"] > 0  # a waited for b

        # b goes silent: a's next round waits for b's heartbeat to expire, then goes on alone.
        # (a keeps heartbeating while it waits, as its manager server would.)
        done = threading.Event()

        def keep_beating() -> None:
            while not done.wait(0.05):
                a.heartbeat("a")

        beats = Background(keep_beating)
        sum_before = m[P + "quorum_round_duration_seconds_sum"]
        try:
            sent = time.monotonic()
            q = a.quorum("a", timeout=TIMEOUT, step=8)
            answered = time.monotonic()
        finally:
            done.set()
            beats.join()
        assert [p.replica_id for p in q.participants] == ["a"]
        m = wait_until(
            lambda: (s := scrape(url))[P + "heartbeats_expired_total"] == 1 and s,
            what="b's heartbeat expiry reported",
        )
        assert m[P + "quorum_rounds_total"] == 2
        assert m[P + "quorum_id"] == 2
        assert m[P + "quorum_size"] == 1
        assert m[P + "members_lost_total"] == 1
        assert m[P + "replicas_heartbeating"] == 1
        assert m[P + "heartbeats_total"] > 10  # a's (quorum requests are not counted)
        assert m[P + "quorum_requests_total"] == 3
        assert m[P + "quorum_round_duration_seconds_count"] == 2
        # The round began when a's request arrived and ended before a heard back (a causal
        # bound, not a speed goal): the round clock restarts every round.
        assert 0 < m[P + "quorum_round_duration_seconds_sum"] - sum_before <= answered - sent
        a.close()
        b.close()


def test_openmetrics_is_served_when_asked_for() -> None:
    from tests.dashboard.helpers import http

    with lighthouse_with_dashboard() as (_, _, url):
        status, headers, body = http(
            url + "metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        assert status == 200
        assert headers["Content-Type"].startswith("application/openmetrics-text")
        assert body.rstrip().endswith(b"# EOF")
        assert b"torchheal_lighthouse_quorum_rounds_total 0" in body


class Exploding:
    """An observer whose every method fails."""

    def __getattr__(self, name: str):
        def fail(*args: object) -> None:
            raise RuntimeError(f"observer bug in {name}")

        return fail


def test_a_failing_observer_never_breaks_the_lighthouse(caplog: pytest.LogCaptureFixture) -> None:
    lh = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=200, observer=Exploding()
    )
    try:
        client = LighthouseClient(f"127.0.0.1:{lh.port()}", TIMEOUT)
        client.heartbeat("gone")  # expires: the periodic expiry report fails too
        wait_until(lambda: lh.status()["heartbeats"]["gone"] > 0.2, what="gone to expire")
        client.heartbeat("a")
        q = client.quorum("a", timeout=TIMEOUT)
        assert [p.replica_id for p in q.participants] == ["a"]
        wait_until(
            lambda: "lighthouse observer failed on expired" in caplog.text,
            what="the expiry report's failure logged",
        )
        assert "lighthouse observer failed on heartbeat" in caplog.text
        # The observer hears of the quorum on the lighthouse's thread, possibly after the
        # answer reached the client.
        wait_until(
            lambda: "lighthouse observer failed on quorum_issued" in caplog.text,
            what="the quorum report's failure logged",
        )
        client.close()
    finally:
        lh.shutdown()


def test_histogram_buckets_are_cumulative_with_le_bounds() -> None:
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 7.0):
        h.observe(value)
    snap = h.snapshot()
    assert snap.cumulative == (2, 4, 5)  # <= 0.1, <= 1.0, +Inf
    assert snap.count == 5
    assert snap.sum == pytest.approx(8.65)
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram((1.0, 1.0))
