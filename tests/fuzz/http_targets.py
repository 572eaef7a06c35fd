"""The HTTP endpoints under fuzzing: checkpoint server, lighthouse dashboard, parameter server.

Each target is a real server on loopback fed raw requests from :mod:`tests.fuzz.http_inputs`
with the endpoint's own paths mixed in, so the generated requests reach its routes and query
parsing, not only its request parser.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from hypothesis import strategies as st

from tests.fuzz.http_inputs import HttpInput, http_inputs, send_http
from tests.fuzz.runner import ACCEPTED, UNCLEAR, Outcome
from torchheal.checkpointing import HTTPTransport
from torchheal.coordination import LighthouseClient, LighthouseServer
from torchheal.coordination.lighthouse.dashboard import DashboardServer, LighthouseRecorder
from torchheal.parameter_server import ParameterServer
from torchheal.process_group.base import ProcessGroup
from torchheal.process_group.dummy import ProcessGroupDummy

TOKEN = "fuzz-token"
T = timedelta(seconds=10)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until true (states only observable by polling)."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: an interruptible pause between polls
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        pause.wait(0.002)


def _paths(templates: list[str], **parts: list[str]) -> st.SearchStrategy[str]:
    """Targets built from ``templates`` whose ``{name}`` holes take values from ``parts``."""

    @st.composite
    def build(draw: st.DrawFn) -> str:
        template = draw(st.sampled_from(templates))
        return template.format(**{k: draw(st.sampled_from(v)) for k, v in parts.items()})

    return build()


class _HttpTarget:
    name = ""
    port = 0
    _strategy: st.SearchStrategy[HttpInput]

    def inputs(self) -> st.SearchStrategy[HttpInput]:
        return self._strategy

    def known(self) -> list[HttpInput]:
        return []

    def send(self, value: HttpInput) -> Outcome:
        return send_http(self.port, value)


# --------------------------------------------------------------------------------------------
# Checkpoint transport server


CHUNK_KEYS = ["0", "1", "-1", "1023", "1024", "99999", "a", "", "%66ull"]
CHUNK_QUERIES = ["?n=1", "?n=2", "?n=0", "?n=1024", "?n=1025", "?n=-1", "?n=abc", "?n="]
CHUNK_QUERIES += ["?n=" + "9" * 5000, "?n=1&n=2", "?x=1", "?n=%00", "?n=\u0662"]
ASSETS = ["app.js", "style.css", "index.html", "vendor/uPlot.iife.min.js", "nope.js"]
ASSETS += ["favicon.svg", "vendor/", "", "%2e%2e/app.py", "..%2F..%2Fapp.py", "%00", "a%00b"]
ASSETS += ["a" * 5000, "\u00e9", "%ff", "vendor/%2e%2e/%2e%2e/app.py"]


def checkpoint_state() -> dict[str, Any]:
    """The state the fuzzed checkpoint server serves (small: accepted requests stay cheap)."""
    return {"w": torch.arange(1000.0), "nested": [torch.ones(3, 4), 7, "x"], "step": 5}


class CheckpointServerTarget(_HttpTarget):
    """``GET /checkpoint/{step}/{key}`` of an ``HTTPTransport`` serving step 5, with a token."""

    name = "checkpoint HTTP server"
    STEP = 5

    def __init__(self) -> None:
        self.transport: HTTPTransport[Any] = HTTPTransport(
            timeout=T, num_chunks=0, token=TOKEN, hostname="127.0.0.1"
        )
        self.state = checkpoint_state()
        self.transport.send_checkpoint([1], self.STEP, self.state)
        self.port = self.transport._server.server_port
        paths = _paths(
            ["/checkpoint/{step}/{key}{query}"] * 6
            + ["/checkpoint/{step}", "/checkpoint/", "/checkpointx/5/full", "/checkpoint//full"]
            + ["/checkpoint/5/full/", "/checkpoint/5/full/x", "/"],
            step=["5"] * 4
            + ["4", "6", "-1", "0", "9" * 30, "abc", "+5", " 5", "5_0", "\u0665", "5.0", ""],
            key=["full", "full", "metadata", "metadata", *CHUNK_KEYS],
            query=["", "", *CHUNK_QUERIES],
        )
        self._strategy = http_inputs(paths.map(lambda p: ("GET", p)), TOKEN)

    def snapshot(self) -> Any:
        t = self.transport
        # A handler lets go of the checkpoint just after its last write: let it finish.
        wait_for(lambda: t._wait_requests_done(0), "in-flight checkpoint requests to finish")
        return (t._step, id(t._staged), t._live is None)

    def alive(self) -> str | None:
        return None if self.transport._thread.is_alive() else "the server thread died"

    def normal(self) -> str | None:
        """A healer fetches the state (one stream, then 3 chunks) and gets it whole."""
        for chunks in (0, 3):
            healer: HTTPTransport[Any] = HTTPTransport(
                timeout=T, num_chunks=chunks, token=TOKEN, hostname="127.0.0.1"
            )
            try:
                got = healer.recv_checkpoint(0, self.transport.metadata(), self.STEP)
            except Exception as e:
                return f"num_chunks={chunks}: {e}"
            finally:
                healer.shutdown()
            if not (torch.equal(got["w"], self.state["w"]) and got["nested"][1:] == [7, "x"]):
                return f"num_chunks={chunks}: received a different state"
        return None

    def close(self) -> None:
        self.transport.shutdown()


# --------------------------------------------------------------------------------------------
# Lighthouse dashboard


class DashboardTarget(_HttpTarget):
    """Every route of the lighthouse's dashboard, with a job token; kills are recorded."""

    name = "lighthouse dashboard"
    A = "a:0b5f0a4e-7c1e-4a8e-9d8b-1f2e3d4c5b6a"

    def __init__(self) -> None:
        self.kills: list[tuple[str, str]] = []
        self.recorder = LighthouseRecorder()
        self.lighthouse = LighthouseServer(
            bind="127.0.0.1:0", min_replicas=1, observer=self.recorder
        )
        self.dashboard = DashboardServer(
            self.lighthouse,
            self.recorder,
            host="127.0.0.1",
            port=0,
            token=TOKEN,
            kill=lambda address, message: self.kills.append((address, message)),
        )
        self.port = self.dashboard.port
        client = LighthouseClient(f"127.0.0.1:{self.lighthouse.port()}", T)
        client.quorum(self.A, timeout=T, step=3, address="http://127.0.0.1:9")
        client.close()
        since = ["0", "1", "-1", "nan", "inf", "-inf", "1e400", "abc", "", "9" * 400, "0x10"]
        replica = [self.A, "a", "zz", "", "%00", "..%2F..", "a" * 5000, "%2F", "\u00e9"]
        paths = _paths(
            ["/", "/api/status", "/api/status?series_since={since}", "/metrics"]
            + ["/static/{asset}"] * 3
            + ["/api/replicas/{replica}/kill", "/replica/{replica}/kill"] * 3
            + ["/favicon.ico", "/api/", "/api/status/", "/nope", "/api/replicas//kill"],
            since=since,
            asset=ASSETS,
            replica=replica,
        )
        # Kill routes are POSTed, the others fetched.
        routes = paths.map(lambda p: ("POST" if p.endswith("/kill") else "GET", p))
        self._strategy = http_inputs(routes, TOKEN)

    def snapshot(self) -> Any:
        return (len(self.kills), self.lighthouse.status()["quorum_id"])

    def alive(self) -> str | None:
        if not self.dashboard._thread.is_alive():
            return "the dashboard thread died"
        return None if self.lighthouse._server._thread.is_alive() else "the lighthouse died"

    def normal(self) -> str | None:
        base = f"http://127.0.0.1:{self.port}"
        try:
            with urllib.request.urlopen(f"{base}/api/status", timeout=10) as response:
                status = json.loads(response.read())
            request = urllib.request.Request(
                f"{base}/api/replicas/{self.A}/kill",
                method="POST",
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            before = len(self.kills)
            with urllib.request.urlopen(request, timeout=10) as response:
                answer = json.loads(response.read())
        except Exception as e:
            return str(e)
        if status["quorum"]["id"] < 1 or not answer["ok"] or len(self.kills) != before + 1:
            return f"unexpected answers: {status['quorum']} {answer}"
        return None

    def close(self) -> None:
        self.dashboard.shutdown()
        self.lighthouse.shutdown()


# --------------------------------------------------------------------------------------------
# Parameter server


class _SessionServer(ParameterServer):
    """Sessions on a ``ProcessGroupDummy`` (no peer needed): the HTTP endpoint is under test."""

    def __init__(self, **kwargs: Any) -> None:
        self.sessions: list[str] = []
        super().__init__(**kwargs)

    @classmethod
    def new_process_group(cls) -> ProcessGroup:
        return ProcessGroupDummy()

    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        self.sessions.append(session_id)


class ParameterServerTarget(_HttpTarget):
    """``GET /new_session`` of a parameter server with a token."""

    name = "parameter server"

    def __init__(self) -> None:
        self.server = _SessionServer(port=0, hostname="127.0.0.1", token=TOKEN)
        self.port = self.server._server.server_address[1]
        paths = st.sampled_from(
            ["/new_session"] * 4
            + ["/new_session?x=1", "/new_session/", "/new_sessionx", "/", "/NEW_SESSION"]
            + ["/new_session#frag", "/new_session?" + "a" * 5000, "/new_session/../new_session"]
        )
        self._strategy = http_inputs(paths.map(lambda p: ("GET", p)), TOKEN)

    def send(self, value: HttpInput) -> Outcome:
        before = len(self.server.sessions)
        outcome = super().send(value)
        if outcome.kind == ACCEPTED and outcome.detail == "200":
            # The session runs on the request's thread after the answer: let it finish.
            try:
                wait_for(lambda: len(self.server.sessions) > before, "the session to run")
                wait_for(lambda: self.server.active_sessions() == 0, "the session to end")
            except AssertionError as e:
                return Outcome(UNCLEAR, f"answered 200 but {e}")
        return outcome

    def snapshot(self) -> Any:
        return (len(self.server.sessions), self.server.active_sessions())

    def alive(self) -> str | None:
        return None if self.server._thread.is_alive() else "the server thread died"

    def normal(self) -> str | None:
        before = len(self.server.sessions)
        try:
            pg = _SessionServer.new_session(self.server.address(), token=TOKEN, timeout=10)
            pg.shutdown()
            wait_for(lambda: len(self.server.sessions) > before, "the session to run")
        except Exception as e:
            return str(e)
        return None

    def close(self) -> None:
        self.server.shutdown(timeout=10)


def all_targets() -> dict[str, Any]:
    """Constructors of every HTTP target, by table name."""
    return {
        CheckpointServerTarget.name: CheckpointServerTarget,
        DashboardTarget.name: DashboardTarget,
        ParameterServerTarget.name: ParameterServerTarget,
    }


__all__ = ["UNCLEAR", "all_targets"]
