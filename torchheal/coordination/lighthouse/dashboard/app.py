"""The dashboard's HTTP routes (aiohttp): the page, its JSON, Prometheus, and the kill action.

``GET /``, ``/static/{path}``, ``/api/status[?series_since=T]`` (with the chart buckets newer
than ``T``; ``0``: all), ``/metrics``, and ``POST /api/replicas/{replica_id}/kill`` (and the
reference's ``/replica/{replica_id}/kill``), which needs the job token as a bearer token when
one is set. Runs on the dashboard's own loop; the kill RPC runs in its thread pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from torchheal.coordination.lighthouse.dashboard.events import group_name
from torchheal.coordination.lighthouse.dashboard.history import History
from torchheal.coordination.lighthouse.dashboard.recorder import LighthouseRecorder
from torchheal.coordination.lighthouse.dashboard.view import build_status
from torchheal.coordination.rpc.auth import RefusalLog, bearer_matches
from torchheal.metrics.exposition import new_registry, render
from torchheal.metrics.lighthouse import LighthouseCollector

__all__ = ["REQUIRED_ASSETS", "STATIC_DIR", "DashboardApp", "missing_assets"]

logger: logging.Logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
#: Files the page needs, relative to ``STATIC_DIR``; vendor files are build output.
REQUIRED_ASSETS: tuple[str, ...] = (
    "index.html",
    "app.js",
    "marks.js",
    "style.css",
    "vendor/uPlot.iife.min.js",
    "vendor/uPlot.min.css",
)
ASSETS_HINT = (
    "This torchheal was installed without its dashboard assets (they are fetched from the npm "
    "registry at set-up time, never from a CDN). In a source checkout run "
    "'bash scripts/setup_env.sh' (or 'make setup'), then reinstall or restart the lighthouse."
)
KILL_MESSAGE = "killed from dashboard"
KILL_TIMEOUT = timedelta(seconds=5)

# The page loads nothing from elsewhere; uPlot sizes its canvases with inline styles.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def missing_assets(static_dir: Path = STATIC_DIR) -> tuple[str, ...]:
    """The required page assets that are not installed in ``static_dir``."""
    return tuple(name for name in REQUIRED_ASSETS if not (static_dir / name).is_file())


class DashboardApp:
    """The routes and the state behind them; used from the dashboard loop only.

    ``kill(manager address, message)`` asks a manager to exit (raises on failure; called on a
    worker thread); ``token`` None or empty leaves actions open; ``metrics_auth``: ``/metrics``
    needs the token too.
    """

    def __init__(
        self,
        status: Callable[[], dict[str, Any]],
        recorder: LighthouseRecorder,
        kill: Callable[[str, str], None],
        token: str | None = None,
        address: str = "",
        history: History | None = None,
        static_dir: Path = STATIC_DIR,
        metrics_auth: bool = False,
    ) -> None:
        self._status = status
        self._recorder = recorder
        self._kill = kill
        self._token = token or None
        self._metrics_auth = metrics_auth
        self._refusals = RefusalLog(logger)
        self._address = address
        self.history = history or History()
        self._static = static_dir.resolve()
        self._missing = missing_assets(static_dir)
        if self._missing:
            logger.warning(
                "dashboard assets missing: %s. %s", ", ".join(self._missing), ASSETS_HINT
            )
        self.registry = new_registry(LighthouseCollector(recorder, status))

    def build(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(middlewares=[_security_headers])
        app.router.add_get("/", self.index)
        app.router.add_get("/static/{path:.+}", self.static)
        app.router.add_get("/api/status", self.api_status)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/api/replicas/{replica_id}/kill", self.kill)
        app.router.add_post("/replica/{replica_id}/kill", self.kill)
        return app

    def sync(self) -> None:
        """Fold the events the lighthouse queued since the last call into the history."""
        apply = self.history.apply
        for event in self._recorder.drain():
            apply(event)

    # ------------------------------------------------------------------------------------------
    # Handlers

    async def index(self, request: web.Request) -> web.StreamResponse:
        page = self._static / "index.html"
        if not page.is_file():
            return web.Response(
                status=500,
                content_type="text/html",
                text=f"<h1>torchheal dashboard unavailable</h1><p>{ASSETS_HINT}</p>"
                "<p>The lighthouse itself is running; <a href='/metrics'>/metrics</a> and "
                "<a href='/api/status'>/api/status</a> still work.</p>",
            )
        return web.FileResponse(page)

    async def static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["path"]
        try:
            path = (self._static / name).resolve()
            if not path.is_relative_to(self._static):
                raise web.HTTPNotFound(text="not found")
            found = path.is_file()
        except (ValueError, OSError):  # a NUL byte, a name too long for the file system
            found = False
        if not found:
            hint = ASSETS_HINT if name in REQUIRED_ASSETS else ""
            raise web.HTTPNotFound(text=f"dashboard asset {name!r} is not installed. {hint}")
        return web.FileResponse(path)

    async def api_status(self, request: web.Request) -> web.Response:
        since_text = request.query.get("series_since")
        since: float | None = None
        if since_text is not None:
            try:
                since = float(since_text)
            except ValueError:
                raise web.HTTPBadRequest(
                    text=f"series_since must be a number of seconds, got {since_text!r}"
                ) from None
        self.sync()
        now = time.time()
        document = build_status(
            self._status(),
            self.history.view(now),
            now,
            address=self._address,
            token_required=self._token is not None,
            missing_assets=self._missing,
        )
        if since is not None:
            document["series"] = self.history.series(now, since=since if since > 0 else None)
        return web.json_response(document, dumps=_dumps)

    async def metrics(self, request: web.Request) -> web.Response:
        if self._metrics_auth and self._token is not None:
            header = request.headers.get("Authorization")
            if not bearer_matches(header, self._token):
                why = "no job token" if header is None else "wrong job token"
                self._refusals.refused("GET /metrics", request.remote, why)
                return web.Response(
                    status=401,
                    text=f"{why}: /metrics requires the job token\n",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        body, content_type = render(self.registry, request.headers.get("Accept"))
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    async def kill(self, request: web.Request) -> web.Response:
        replica_id = request.match_info["replica_id"]
        refusal = self._refuse(request)
        if refusal is not None:
            return refusal
        prev = self._status()["prev_quorum"]
        members = prev["participants"] if prev else []
        # A group's name is accepted too: its current replica id is then the target.
        match = [m for m in members if m["replica_id"] == replica_id] or [
            m for m in members if group_name(m["replica_id"]) == replica_id
        ]
        if not match:
            return _error(404, f"replica {replica_id!r} is not in the current quorum")
        member = match[0]
        target, address = member["replica_id"], member["address"]
        if not address:
            return _error(409, f"replica {target!r} did not report a manager address")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self._kill, address, KILL_MESSAGE)
        except Exception as e:
            logger.warning("dashboard: kill of %s at %s failed: %s", target, address, e)
            return _error(502, f"could not ask {target} at {address} to exit: {e}")
        logger.warning("dashboard: asked replica %s at %s to exit", target, address)
        self._recorder.killed(target)
        return web.json_response(
            {"ok": True, "replica_id": target, "message": f"asked {target} to exit"}
        )

    def _refuse(self, request: web.Request) -> web.Response | None:
        # A browser names the origin on a cross-site POST: refuse those, so a page elsewhere
        # cannot make a visitor's browser kill groups of an open dashboard.
        origin = request.headers.get("Origin")
        if origin is not None and _netloc(origin) != request.host:
            return _error(403, "refused: cross-origin request")
        if self._token is None:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            self._refusals.refused(f"POST {request.path[:200]}", request.remote, "no job token")
            return _error(
                401,
                "refused: this lighthouse requires the job token for actions; enter it in the "
                "token field (it is the TORCHHEAL_TOKEN the job was started with)",
            )
        if not bearer_matches(header, self._token):
            self._refusals.refused(f"POST {request.path[:200]}", request.remote, "wrong job token")
            return _error(401, "refused: wrong job token")
        return None


def _netloc(origin: str) -> str | None:
    """The host:port of an ``Origin`` header; None when it does not parse (never our host)."""
    try:
        return urlsplit(origin).netloc
    except ValueError:  # e.g. "http://[": an unterminated IPv6 literal
        return None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"ok": False, "error": message}, status=status)


def _dumps(value: Any) -> str:
    # No NaN/Infinity in JSON: browsers' JSON.parse rejects them.
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


@web.middleware
async def _security_headers(request: web.Request, handler: Any) -> web.StreamResponse:
    response = await handler(request)
    response.headers.update(SECURITY_HEADERS)
    return response
