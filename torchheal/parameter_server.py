"""A prototype parameter server: one fresh two-member process group per client session.

A client's ``GET /new_session`` gets a session id and a store address of its own; both sides
configure a process group on it (server rank 0, client rank 1), so a dead client breaks only its
session. Unlike the reference: a 400 names a malformed request, an optional token guards the
endpoint, :meth:`ParameterServer.shutdown` stops the server, and the advertised host can be set.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import urllib.request
import uuid
from abc import ABC, abstractmethod
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch.distributed as dist

from torchheal.process_group.base import ProcessGroup

logger: logging.Logger = logging.getLogger(__name__)

__all__ = ["ParameterServer"]

_SESSION_PATH = "/new_session"


class _IPv6HTTPServer(ThreadingHTTPServer):
    # Dual-stack: "::" also accepts IPv4 clients where the OS allows it (Linux default).
    address_family = socket.AF_INET6
    daemon_threads = True


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class ParameterServer(ABC):
    """Serves sessions over HTTP; each session gets its own process group with the client.

    Args:
        port: HTTP port to listen on (0 picks a free one).
        store_port: port of the rendezvous TCPStore (0 picks a free one).
        hostname: host name advertised in addresses (default ``socket.gethostname()``).
        token: optional shared secret; requests must send ``Authorization: Bearer <token>``.
        store_timeout: timeout of the rendezvous store.
    """

    def __init__(
        self,
        port: int,
        store_port: int = 0,
        *,
        hostname: str | None = None,
        token: str | None = None,
        store_timeout: timedelta = timedelta(seconds=60),
    ) -> None:
        self._hostname = hostname or socket.gethostname()
        self._token = token
        self._store = dist.TCPStore(
            host_name="0.0.0.0",
            port=store_port,
            is_master=True,
            wait_for_workers=False,
            timeout=store_timeout,
        )
        handler = self._make_handler()
        try:
            self._server: ThreadingHTTPServer = _IPv6HTTPServer(("::", port), handler)
        except OSError:
            # No IPv6 on this host: serve IPv4 only.
            self._server = ThreadingHTTPServer(("0.0.0.0", port), handler)
            self._server.daemon_threads = True
        self._sessions_changed = threading.Condition()
        self._active_sessions: set[str] = set()
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="parameter_server", daemon=True
        )
        self._thread.start()
        logger.info("parameter server listening on %s", self.address())

    # -- what subclasses provide ---------------------------------------------------------

    @classmethod
    @abstractmethod
    def new_process_group(cls) -> ProcessGroup:
        """A fresh, not yet configured, reconfigurable process group for one session."""

    @abstractmethod
    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        """Runs one session on its own thread (``pg``: server rank 0, client rank 1); returning
        or raising ends it."""

    # -- addresses and lifecycle ---------------------------------------------------------

    def address(self) -> str:
        """The URL a client passes to :meth:`new_session`."""
        port = self._server.server_address[1]
        return f"http://{_format_host(self._hostname)}:{port}{_SESSION_PATH}"

    def store_port(self) -> int:
        """The port of the rendezvous TCPStore."""
        return self._store.port

    def active_sessions(self) -> int:
        """How many sessions are running right now."""
        with self._sessions_changed:
            return len(self._active_sessions)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stops accepting requests and waits up to ``timeout`` seconds for sessions to end."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
        with self._sessions_changed:
            if not self._sessions_changed.wait_for(lambda: not self._active_sessions, timeout):
                logger.warning(
                    "parameter server shut down with %d sessions still running",
                    len(self._active_sessions),
                )

    # -- client side ---------------------------------------------------------------------

    @classmethod
    def new_session(
        cls, address: str, token: str | None = None, timeout: float = 60.0
    ) -> ProcessGroup:
        """Starts a session on a server and returns the configured group (client is rank 1).

        Args:
            address: the server's :meth:`address`.
            token: the server's shared token, if it has one.
            timeout: seconds to wait for the HTTP answer.
        """
        request = urllib.request.Request(address)
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        try:
            data = json.loads(body)
            session_id = str(data["session_id"])
            store_addr = str(data["store_addr"])
        except (ValueError, KeyError, TypeError) as e:
            raise RuntimeError(f"invalid session answer from {address}: {body[:200]!r}") from e
        logger.info("session %s: configuring on %s", session_id, store_addr)
        pg = cls.new_process_group()
        pg.configure(store_addr, replica_id="1", rank=1, world_size=2)
        return pg

    # -- server side ---------------------------------------------------------------------

    def _run_session(self, session_id: str, store_addr: str) -> None:
        with self._sessions_changed:
            self._active_sessions.add(session_id)
        pg: ProcessGroup | None = None
        try:
            pg = self.new_process_group()
            pg.configure(store_addr, replica_id="0", rank=0, world_size=2)
            self.forward(session_id, pg)
        except Exception:
            # A broken session (client gone, bad data) ends here; others keep running.
            logger.exception("session %s ended with an error", session_id)
        finally:
            if pg is not None:
                try:
                    pg.shutdown()
                except Exception:
                    logger.exception("session %s: shutting down its process group", session_id)
            with self._sessions_changed:
                self._active_sessions.discard(session_id)
                self._sessions_changed.notify_all()
            logger.info("session %s finished", session_id)

    def _make_handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class _Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Requests too broken to name a version still get a status line and plain text.
            default_request_version = "HTTP/1.1"
            error_content_type = "text/plain; charset=utf-8"
            error_message_format = "%(code)d %(message)s: %(explain)s\n"

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("%s - %s", self.address_string(), format % args)

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
                self.wfile.flush()
                self.close_connection = True

            def _error(self, code: int, message: str) -> None:
                self._send(code, (message + "\n").encode(), "text/plain; charset=utf-8")

            def _authorized(self) -> bool:
                if server._token is None:
                    return True
                auth = self.headers.get("Authorization")
                if auth is None:
                    self._error(401, "parameter server token required")
                    return False
                if not hmac.compare_digest(auth.encode(), f"Bearer {server._token}".encode()):
                    self._error(403, "invalid parameter server token")
                    return False
                return True

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                path = self.path.split("?", 1)[0]
                if path != _SESSION_PATH:
                    self._error(
                        400, f"unknown path {path!r}: the only endpoint is GET {_SESSION_PATH}"
                    )
                    return
                session_id = str(uuid.uuid4())
                store_addr = (
                    f"{_format_host(server._hostname)}:{server.store_port()}/session/{session_id}"
                )
                body = json.dumps({"session_id": session_id, "store_addr": store_addr}) + "\n"
                self._send(200, body.encode(), "application/json")
                # The answer is out and the connection closed: this thread now runs the session.
                self.connection.shutdown(socket.SHUT_RDWR)
                server._run_session(session_id, store_addr)

            def _unsupported(self) -> None:
                self._error(400, f"unsupported method {self.command}: use GET {_SESSION_PATH}")

            do_POST = do_PUT = do_DELETE = do_PATCH = _unsupported
            do_HEAD = do_OPTIONS = do_TRACE = do_CONNECT = _unsupported

        return _Handler
