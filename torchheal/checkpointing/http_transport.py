"""HTTP checkpoint transport: a healthy replica serves its staged state, healers pull it.

Server: a dual-stack ``ThreadingHTTPServer`` serving ``GET /checkpoint/{step}/{key}``, keys
``full`` (header, description, data), ``metadata`` (header, description) and ``{i}`` (chunk ``i``
of ``?n=``, else ``num_chunks``). Each request holds the checkpoint it reads; the next
``send_checkpoint`` retires it without waiting, so a stalled healer never delays the next heal.

Client (``_http_fetch``): reads straight into preallocated storages, verifying every block.

Access control (``docs/security.md``): with a token every request must carry ``Authorization:
Bearer <token>`` (else 401); with TLS the server speaks HTTPS only and a TLS client refuses a
plain ``http://`` peer. ``_http_limits`` bounds what a client can make the server hold.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from datetime import timedelta
from http.server import ThreadingHTTPServer
from socketserver import TCPServer
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from torchheal._base.security import SecurityEnv
from torchheal._base.timeouts import to_seconds
from torchheal.checkpointing._direct_send import SocketDirectSend
from torchheal.checkpointing._http_errors import receive_error
from torchheal.checkpointing._http_fetch import Aborts, Client, fetch
from torchheal.checkpointing._http_limits import LimitedHandler, LimitedServer
from torchheal.checkpointing.live import LIVE_FROM_BYTES, LiveCheckpoint
from torchheal.checkpointing.serialization import (
    DEFAULT_BLOCK_BYTES,
    StagedCheckpoint,
    StagingPool,
    split_chunks,
    stage,
)
from torchheal.checkpointing.timeline import mark
from torchheal.checkpointing.transport import (
    CheckpointError,
    CheckpointTransport,
)
from torchheal.coordination.rpc.auth import RefusalLog, bearer_matches
from torchheal.coordination.rpc.tls import client_ssl_context, server_ssl_context

logger = logging.getLogger(__name__)

T = TypeVar("T")

_MAX_CHUNKS = 1024
#: How long a request for a newer step waits for a send of that step to begin.
UNANNOUNCED_WAIT_S = 2.0


class _Server(LimitedServer, ThreadingHTTPServer):
    """Threading HTTP server bound dual-stack, limited; its handler reaches the transport."""

    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, transport: HTTPTransport, context: ssl.SSLContext | None) -> None:
        self.transport = transport
        self.ssl_context = context
        self.refusals = RefusalLog(logger)
        self.address_family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
        host = "::" if self.address_family == socket.AF_INET6 else "0.0.0.0"
        super().__init__((host, 0), _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            # Dual-stack: IPv4 peers connect through mapped addresses.
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # TCPServer's bind, not HTTPServer's: that one does a (slow) reverse DNS lookup.
        TCPServer.server_bind(self)
        self.server_name, self.server_port = "", self.server_address[1]

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = self.socket.accept()
        if self.ssl_context is not None:
            # The handshake happens in the request's own thread (_Handler.setup), under its
            # timeout: a peer that never completes it cannot stall the accepting thread.
            sock = self.ssl_context.wrap_socket(
                sock, server_side=True, do_handshake_on_connect=False
            )
        return sock, address


class _Handler(LimitedHandler):
    server: _Server
    # A request too broken to name a version still gets a status line (not an HTTP/0.9 page).
    default_request_version = "HTTP/1.1"

    def setup(self) -> None:
        self.timeout = self.server.transport._timeout  # per-connection socket timeout
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(self.timeout)
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("checkpoint server: " + format, *args)

    def _error(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        body = message.encode()
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _method_not_allowed(self) -> None:
        self._error(405, f"method {self.command} not allowed: use GET", {"Allow": "GET"})

    do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _method_not_allowed
    do_OPTIONS = do_TRACE = do_CONNECT = _method_not_allowed

    def do_GET(self) -> None:
        transport = self.server.transport
        token = transport._token
        if token is not None:
            auth = self.headers.get("Authorization")
            if not bearer_matches(auth, token):
                why = "no job token" if auth is None else "wrong job token"
                self.server.refusals.refused(f"GET {self.path[:200]}", self.client_address, why)
                self._error(
                    401,
                    f"{why}: this checkpoint server requires the job token",
                    {"WWW-Authenticate": "Bearer"},
                )
                return
        url = urlsplit(self.path)
        parts = url.path.split("/")
        step_text = parts[2] if len(parts) == 4 and parts[1] == "checkpoint" else ""
        if not (step_text.isascii() and step_text.isdigit()):  # int() takes "+5", "5_0", " 5"
            self._error(
                400, f"invalid url format, expected /checkpoint/step/key but got {url.path}"
            )
            return
        step = int(step_text)
        # A healer may ask before its source has staged that step (both run beside the step's
        # collectives): wait for it rather than refuse the newer step.
        transport._wait_for_step(step)
        live, served = transport._open_request()
        try:
            if live is None:
                self._error(503, f"checkpoint for step={step} not available: nothing is served")
                return
            if step != served:
                self._error(
                    400, f"invalid checkpoint requested, serving {served} but got step={step}"
                )
                return
            self._serve(transport, live, parts[3], url.query)
        except (ConnectionError, TimeoutError, OSError) as e:
            # The peer went away or stalled mid-transfer: its receive fails, the server lives on.
            logger.info("checkpoint server: transfer to %s aborted: %s", self.client_address, e)
            self.close_connection = True
        except CheckpointError as e:
            # A block is no longer served or changed while served live: the stream ends short
            # and the healer's receive fails (nothing wrong is ever sent).
            logger.warning("checkpoint server: transfer to %s ended: %s", self.client_address, e)
            self.close_connection = True
        finally:
            transport._close_request(live)

    def _serve(self, transport: HTTPTransport, live: LiveCheckpoint, key: str, query: str) -> None:
        staged = live.staged
        if key == "full":
            head: list[bytes] = [staged.header, staged.description]
            segments = list(staged.segments)
        elif key == "metadata":
            head, segments = [staged.header, staged.description], []
        else:
            try:
                n = int(parse_qs(query).get("n", [str(transport._num_chunks)])[0])
                index = int(key)
            except ValueError:
                self._error(400, f"invalid checkpoint key {key!r}")
                return
            if not 0 < n <= _MAX_CHUNKS or not 0 <= index < n:
                self._error(400, f"invalid checkpoint chunk {key} of {n}")
                return
            head, segments = [], split_chunks(staged.segments, n)[index]
        length = sum(len(h) for h in head) + sum(s.end - s.start for s in segments)
        mark("serve.begin", key=key, nbytes=length)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.end_headers()
        for h in head:
            self.wfile.write(h)
        if isinstance(self.connection, ssl.SSLSocket):
            # TLS records are retried with the same bytes: through a private copy.
            live.write(self.wfile.write, segments)
        else:
            with SocketDirectSend(self.connection, transport._timeout) as direct:
                live.write(self.wfile.write, segments, direct)
        mark("serve.end", key=key)


class HTTPTransport(CheckpointTransport[T]):
    """Serves checkpoints over HTTP from this replica and fetches them from peers.

    What is served is the state itself until ``disallow_checkpoint``, then a copy of what the
    healers had not yet received (:class:`~torchheal.checkpointing.live.LiveCheckpoint`).

    Args:
        timeout: bound on every lock wait and socket operation (``timedelta`` or seconds).
        num_chunks: 0 fetches one stream; ``n > 0`` fetches ``n`` chunks in parallel.
        token: shared secret required on every request; None: the settings'
            ``transport_token``; empty disables it.
        hostname: name published in ``metadata()``; defaults to ``socket.gethostname()``.
        security: token and TLS settings (None: read from the environment).
    """

    def __init__(
        self,
        timeout: timedelta | float,
        num_chunks: int,
        token: str | None = None,
        *,
        hostname: str | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        security: SecurityEnv | None = None,
    ) -> None:
        if not 0 <= num_chunks <= _MAX_CHUNKS:
            raise ValueError(f"num_chunks must be in [0, {_MAX_CHUNKS}], got {num_chunks}")
        self._timeout = to_seconds(timeout)
        self._num_chunks = num_chunks
        security = SecurityEnv.from_env() if security is None else security
        self._token = (token if token is not None else security.transport_token) or None
        self._client_context: ssl.SSLContext | None = None
        server_context: ssl.SSLContext | None = None
        if security.tls:
            server_context = server_ssl_context(security, "checkpoint server")
            self._client_context = client_ssl_context(security)
        self._scheme = "https" if security.tls else "http"
        self._block_bytes = block_bytes
        self._hostname = hostname or socket.gethostname()
        # Orders allow/disallow/send against each other, and a request's taking of the served
        # checkpoint against its replacement.
        self._state_lock = threading.Condition()  # notified when a request ends
        self._served = threading.Condition()  # notified when a step starts being served
        self._requests = 0  # requests in flight, whatever checkpoint they read
        self._step = -1
        self._staging = -1  # the step the latest send_checkpoint began staging
        self._live: LiveCheckpoint | None = None
        # A storage changed while served live once: copy everything at staging from then on.
        self._stage_copies = False
        self._pool = StagingPool()
        self._receives: set[Aborts] = set()  # the receives in flight (abort_receives)
        self._receives_lock = threading.Lock()
        self._server = _Server(self, server_context)
        # A short poll interval keeps shutdown() quick; the idle cost is negligible.
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="torchheal-ckpt-http",
            daemon=True,
        )
        self._thread.start()

    def address(self) -> str:
        """The URL prefix peers fetch from: ``http(s)://{host}:{port}/checkpoint/``."""
        host = self._hostname
        if ":" in host:
            host = f"[{host}]"
        return f"{self._scheme}://{host}:{self._server.server_port}/checkpoint/"

    def metadata(self) -> str:
        """Same as ``address()``."""
        return self.address()

    copies_state = False
    copies_on_write = True
    runs_beside_collectives = True

    @property
    def _staged(self) -> StagedCheckpoint | None:
        live = self._live
        return None if live is None else live.staged

    def allow_checkpoint(self, step: int) -> None:
        """Starts serving the staged state as ``step`` (idempotent)."""
        with self._state_lock:
            self._step = step
        with self._served:
            self._served.notify_all()

    def _wait_for_step(self, step: int) -> None:
        """Waits until ``step`` or a later one is served, if a send of ``step`` is coming.

        A request may come before its source began staging (both start at the quorum): wait
        briefly for that send to begin, then up to the timeout for it to be served.
        """
        with self._served:
            if self._step >= step:
                return
            self._served.wait_for(
                lambda: self._step >= step or self._staging >= step,
                min(UNANNOUNCED_WAIT_S, self._timeout),
            )
            if self._step < step and self._staging == step:
                self._served.wait_for(lambda: self._step >= step, self._timeout)

    def disallow_checkpoint(self) -> None:
        """The state may change once this returns (idempotent): what the expected healers have
        not yet received is copied first, and they finish from that copy."""
        live = self._live
        if live is not None and not live.frozen:
            mark("freeze.begin")
            live.freeze()
            mark("freeze.end", nbytes=live.copied_bytes)

    def _open_request(self) -> tuple[LiveCheckpoint | None, int]:
        """A request takes the served checkpoint (None: nothing is) and the step served."""
        with self._state_lock:
            live = self._live
            if live is not None:
                live.open_request()
            self._requests += 1
            return live, self._step

    def _close_request(self, live: LiveCheckpoint | None) -> None:
        if live is not None:
            live.close_request()
        with self._state_lock:
            self._requests -= 1
            self._state_lock.notify_all()

    def _wait_requests_done(self, timeout: float) -> bool:
        """Waits until no request is being answered; False if one still is after ``timeout``."""
        with self._state_lock:
            return self._state_lock.wait_for(lambda: self._requests == 0, timeout)

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta | None = None
    ) -> None:
        """Serves ``state_dict``: its large CPU storages live, the rest as private copies.

        The state must not change until ``disallow_checkpoint`` has returned. Downloads of the
        previous checkpoint are not waited for. Blocks delivered ``len(dst_ranks)`` times are
        not copied by ``disallow_checkpoint``; ``timeout`` is unused (the constructor's bounds).
        """
        with self._served:
            self._staging = step  # a request for it may wait for it now
            self._served.notify_all()
        with self._state_lock:
            # Nothing is served until the new copy is: a request for this step (even when it is
            # the step served until now) waits for it in _wait_for_step rather than find none.
            old, self._live = self._live, None
            self._step = -1
        if old is not None:
            old.retire()  # its buffers come back once no request reads them
            self._stage_copies = self._stage_copies or old.unstable
        mark("stage.begin")
        staged = stage(
            state_dict,
            step,
            block_bytes=self._block_bytes,
            pool=self._pool,
            live_from=None if self._stage_copies else LIVE_FROM_BYTES,
        )
        live = LiveCheckpoint(staged, len(dst_ranks), self._pool, self._timeout)
        with self._state_lock:
            self._live = live
        mark("stage.end", nbytes=staged.data_bytes)
        self.allow_checkpoint(step)

    receives_in_place = True

    def recv_checkpoint(
        self,
        src_rank: int,
        metadata: str,
        step: int,
        timeout: timedelta | float | None = None,
        *,
        into: Any = None,
    ) -> T:
        """Fetches and verifies the checkpoint of ``step`` from the server at ``metadata``.

        Args:
            src_rank: ignored (the URL identifies the source).
            metadata: the source's ``metadata()`` URL.
            step: the expected step.
            timeout: socket timeout; defaults to the constructor's.
            into: the receiver's own state: CPU tensors whose storage matches in size and dtype
                are received into directly and returned as themselves.

        Raises:
            CheckpointError: refused (``CheckpointHTTPError``), failed or timed out
                (``CheckpointURLError``, ``CheckpointTimeoutError``), torn after bytes landed
                in ``into`` (``TornCheckpointError``), or wrong, truncated or corrupted data.
        """
        seconds = self._timeout if timeout is None else to_seconds(timeout)
        url = urlsplit(metadata)
        if url.scheme not in ("http", "https") or not url.hostname or url.port is None:
            raise CheckpointError(f"invalid checkpoint address {metadata!r}")
        if url.scheme != self._scheme:
            # Never downgrade: with TLS on, a plain peer is refused (and the other way round
            # there are no authorities to verify it with).
            raise CheckpointError(
                f"checkpoint address {metadata!r} is {url.scheme} but this transport speaks "
                f"{self._scheme}: set the same TORCHHEAL_TLS_* on every replica group"
            )
        base = f"{url.path.rstrip('/')}/{step}"
        aborts = Aborts()
        client = Client(url.hostname, url.port, seconds, self._token, self._client_context, aborts)
        with self._receives_lock:
            self._receives.add(aborts)
        try:
            if seconds <= 0:  # a socket timeout of 0 means non-blocking, not "no time left"
                raise TimeoutError(f"no time left (timeout {seconds} s)")
            return fetch(client, base, step, self._num_chunks, into)
        except (CheckpointError, OSError) as e:
            error = receive_error(e, metadata, aborts.aborted)
            if error is e:
                raise
            raise error from e
        finally:
            with self._receives_lock:
                self._receives.discard(aborts)
            aborts.close()

    def abort_receives(self) -> None:
        """Ends the receives in flight now: their ``recv_checkpoint`` raises
        ``CheckpointError`` (``TornCheckpointError`` where bytes had landed in ``into``)."""
        with self._receives_lock:
            receives = list(self._receives)
        for aborts in receives:
            aborts.abort()

    def shutdown(self, wait: bool = True) -> None:
        """Stops the server; ``wait``: block until the serving thread has exited."""
        if wait:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
        else:
            threading.Thread(target=self._server.shutdown, daemon=True).start()
