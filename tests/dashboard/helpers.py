"""Helpers for the dashboard tests: HTTP calls, Prometheus parsing, polling, a live lighthouse."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from torchheal.coordination.lighthouse.dashboard import DashboardServer, LighthouseRecorder
from torchheal.coordination.lighthouse.server import LighthouseServer


def http(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, timeout: float = 10.0
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request; returns (status, headers, body) for error statuses too."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def get_json(url: str) -> Any:
    status, _, body = http(url)
    assert status == 200, (status, body[:500])
    return json.loads(body)


def scrape(url: str) -> dict[str, float]:
    """``GET /metrics`` parsed: sample name (with labels as ``{k="v"}``) -> value."""
    status, headers, body = http(url + "metrics")
    assert status == 200, (status, body[:500])
    assert headers["Content-Type"].startswith("text/plain")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def wait_until(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something true; return it."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: an interruptible pause between polls
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        pause.wait(0.05)


class Background:
    """Run a function on a thread; :meth:`join` returns its result or raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._result = fn()
        except BaseException as e:
            self._error = e

    def join(self, timeout: float = 20.0) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"still running after {timeout}s"
        if self._error is not None:
            raise self._error
        return self._result


@contextmanager
def lighthouse_with_dashboard(
    min_replicas: int = 1, dashboard: dict[str, Any] | None = None, **lighthouse: Any
) -> Iterator[tuple[LighthouseServer, DashboardServer, str]]:
    """A real lighthouse with its dashboard on loopback; yields (lighthouse, dashboard, url)."""
    recorder = LighthouseRecorder()
    lh = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=min_replicas, observer=recorder, **lighthouse
    )
    try:
        dash = DashboardServer(lh, recorder, host="127.0.0.1", port=0, **(dashboard or {}))
        try:
            yield lh, dash, dash.url("127.0.0.1")
        finally:
            dash.shutdown()
    finally:
        lh.shutdown()
