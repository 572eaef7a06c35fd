"""Parsing of ``host:port/prefix`` store addresses and creation of prefixed TCPStore clients."""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import DistNetworkError, PrefixStore, Store, TCPStore

from torchheal.process_group.gloo_sockets import PairSockets

logger: logging.Logger = logging.getLogger(__name__)

#: Longest connection attempt when it can be abandoned: c10d retries a failed connection until
#: its timeout, so only short attempts let an abandon take effect soon.
CONNECT_ATTEMPT_S = 1.0
#: How long a connection may outlast its timeout before it is cut: c10d waits for the first
#: answer with no timeout, so a frozen host (whose kernel accepts) would hold it forever.
OVERRUN_CUT_S = 1.0
#: How often an overrunning attempt's connection is looked for and cut again, until it ends.
_RECUT_S = 0.05
#: How often a connection that can be abandoned looks whether it was.
_ABANDON_POLL_S = 0.01
#: Pauses between two tries of a host that refused the connection: from the first to the last.
_REFUSED_FIRST_PAUSE_S = 0.01
_REFUSED_LAST_PAUSE_S = 0.25


class StoreConnectAbandoned(RuntimeError):
    """A store connection in progress was abandoned (see :func:`create_store_client`)."""


class _UnansweredConnection(DistNetworkError):
    """The store's host accepted the connection and never answered it (a frozen process)."""


class StoreConnections:
    """This process's connections to a store's ``port`` opened from now on, to be cut.

    Cutting makes a group's build waiting on the rendezvous store fail at once, whichever group
    (ours, NCCL's) opened the client: how a build stuck on a dead peer is given up.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self._before = PairSockets.before()

    def cut(self) -> int:
        """Shuts down those connections still open (any thread, any number of times); the count."""
        return PairSockets.to_port(self._before, self.port).cut()


def parse_store_addr(store_addr: str) -> tuple[str, int, str]:
    """Splits ``"host:port/prefix"``: ``[::1]:1234/a/b`` gives ``("::1", 1234, "a/b")``.

    Raises ``ValueError`` naming the address when it has no prefix, no port, or a bad port.
    """
    hostport, sep, prefix = store_addr.partition("/")
    if not sep:
        raise ValueError(f"store address {store_addr!r} has no '/prefix' (want host:port/prefix)")
    host, sep, port_str = hostport.rpartition(":")
    if not sep or not host:
        raise ValueError(f"store address {store_addr!r} has no host:port (want host:port/prefix)")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"store address {store_addr!r} has an unclosed '[' in its host")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"store address {store_addr!r}: IPv6 hosts must be written as [addr]")
    try:
        port = int(port_str)
    except ValueError:
        raise ValueError(f"store address {store_addr!r} has a non-numeric port") from None
    if not 0 < port < 65536:
        raise ValueError(f"store address {store_addr!r} has port {port} out of range")
    return host, port, prefix


def create_store_client(
    store_addr: str, timeout: timedelta, *, abandoned: threading.Event | None = None
) -> Store:
    """Connects to an existing TCPStore and scopes it under the address's prefix.

    Ends within about ``timeout`` (plus :data:`OVERRUN_CUT_S`) whatever the host does.

    Args:
        store_addr: ``"host:port/prefix"`` (``"[v6addr]:port/prefix"`` for IPv6).
        timeout: connect and per-operation timeout of the store client.
        abandoned: set from another thread to give the connection up
            (:class:`StoreConnectAbandoned`); the connection is then made in short attempts.

    Raises:
        torch.distributed.DistError: no connection within ``timeout``.
    """
    host, port, prefix = parse_store_addr(store_addr)
    if abandoned is None:
        return PrefixStore(prefix, connect_store(host, port, timeout))
    return PrefixStore(prefix, _in_attempts(host, port, timeout, abandoned))


def connect_store(host: str, port: int, timeout: timedelta) -> TCPStore:
    """A c10d client of the TCPStore at ``host:port`` (no prefix), in one attempt that ends
    within ``timeout`` (plus :data:`OVERRUN_CUT_S`) whatever the host does."""
    timeout_s = timeout.total_seconds()
    return _bounded_client(host, port, timeout_s, time.monotonic() + timeout_s)


def _in_attempts(host: str, port: int, timeout: timedelta, abandoned: threading.Event) -> TCPStore:
    """:func:`create_store_client`'s connection when it can be abandoned: short attempts.

    c10d logs every failed attempt with a C++ stack, so after a failure the next attempt waits
    until the host accepts a plain TCP connection. Not before: each probe costs the store's loop a
    name lookup, slow where DNS drops queries (``docs/failures.md``, slow DNS).
    """
    deadline = time.monotonic() + timeout.total_seconds()
    why = f"the connection to the store at {host}:{port} was abandoned"
    failed = False
    while True:
        if failed:
            _await_listener(host, port, timeout, deadline, abandoned, why)
        attempt = max(min(CONNECT_ATTEMPT_S, deadline - time.monotonic()), 0.001)
        try:
            store = _abandonable(
                lambda a=attempt: _bounded_client(host, port, a, deadline), abandoned, why
            )
        except (StoreConnectAbandoned, _UnansweredConnection):
            raise
        except Exception as e:
            if time.monotonic() >= deadline:
                # c10d's message would name the attempt's timeout, with a C++ stack.
                raise _no_store(host, port, timeout, _first_line(e)) from None
            failed = True
            continue
        store.set_timeout(timeout)
        return store


def _await_listener(
    host: str,
    port: int,
    timeout: timedelta,
    deadline: float,
    abandoned: threading.Event,
    why: str,
) -> None:
    """Returns once ``host:port`` accepts a TCP connection, retrying after growing pauses."""
    pause = _REFUSED_FIRST_PAUSE_S
    last = "not tried"
    while True:
        if abandoned.is_set():
            raise StoreConnectAbandoned(why)
        left = deadline - time.monotonic()
        if left <= 0:
            raise _no_store(host, port, timeout, f"{last} (is its host down?)")
        try:
            _accepts(host, port, left, abandoned, why)
            return
        except OSError as e:
            last = e.strerror or str(e) or type(e).__name__
        abandoned.wait(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, _REFUSED_LAST_PAUSE_S)


def _no_store(host: str, port: int, timeout: timedelta, why: str) -> DistNetworkError:
    return DistNetworkError(
        f"no connection to the store at {host}:{port} within the connection's timeout "
        f"({timeout.total_seconds():g}s): {why}"
    )


def _first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (c10d's go on with a C++ stack)."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _accepts(host: str, port: int, timeout_s: float, abandoned: threading.Event, why: str) -> None:
    """Opens a TCP connection to ``host:port`` and closes it (``OSError`` if none accepted)."""
    end = time.monotonic() + timeout_s
    error: OSError = OSError(errno.EADDRNOTAVAIL, f"{host} has no address")
    for family, kind, proto, _name, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as sock:
            sock.setblocking(False)
            code = sock.connect_ex(addr)
            if code in (errno.EINPROGRESS, errno.EAGAIN):
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
                while not poller.poll(_ABANDON_POLL_S * 1000):
                    if abandoned.is_set():
                        raise StoreConnectAbandoned(why)
                    if time.monotonic() >= end:
                        break
                else:
                    code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code == 0:
                return
            if code in (errno.EINPROGRESS, errno.EAGAIN):
                error = TimeoutError(errno.ETIMEDOUT, "the connection was never answered")
            else:
                error = OSError(code, os.strerror(code))
    raise error


def _abandonable(connect: Callable[[], TCPStore], abandoned: threading.Event, why: str) -> TCPStore:
    """``connect()`` on a helper thread; raises :class:`StoreConnectAbandoned` as soon as
    ``abandoned`` is set, leaving a late connection to be closed by its thread."""
    if abandoned.is_set():
        raise StoreConnectAbandoned(why)
    outcome: list[TCPStore | BaseException] = []
    lock = threading.Lock()
    done = threading.Event()
    left = False  # the caller stopped waiting: the attempt's result is not handed over

    def attempt() -> None:
        try:
            result: TCPStore | BaseException = connect()
        except BaseException as e:
            result = e
        with lock:
            if not left:
                outcome.append(result)
        done.set()

    threading.Thread(target=attempt, name="torchheal-store-attempt", daemon=True).start()
    while not done.wait(_ABANDON_POLL_S):
        if abandoned.is_set():
            with lock:
                left = True
            raise StoreConnectAbandoned(why)
    result = outcome.pop()
    if abandoned.is_set():
        cause = result if isinstance(result, Exception) else None
        del result  # a connection made meanwhile: closed now
        raise StoreConnectAbandoned(why) from cause
    if isinstance(result, BaseException):
        raise result
    return result


def _bounded_client(host: str, port: int, timeout_s: float, deadline: float) -> TCPStore:
    """A c10d client of ``host:port`` (one attempt of ``timeout_s``), cut soon after ``deadline``.

    A watchdog cuts the attempt's connections to ``port`` :data:`OVERRUN_CUT_S` past
    ``deadline``: the client fails and, past its own timeout, does not retry.
    """
    before = PairSockets.before()
    ended = threading.Event()
    cut = threading.Event()

    def watch() -> None:
        if ended.wait(max(deadline + OVERRUN_CUT_S - time.monotonic(), 0.0)):
            return
        while True:
            # Nothing to cut: c10d is between two tries of a refused connection, late.
            sockets = PairSockets.to_port(before, port)
            first = len(sockets) > 0 and not cut.is_set()
            if len(sockets):
                cut.set()  # before the cut: the attempt fails on it at once and looks
                sockets.cut()
            if first:
                logger.warning(
                    "the store at %s:%d accepted a connection and has not answered it by the "
                    "connection's timeout (is its host frozen?): cut the connection",
                    host,
                    port,
                )
            if ended.wait(_RECUT_S):
                return

    watchdog = threading.Thread(target=watch, name="torchheal-store-connect", daemon=True)
    watchdog.start()
    try:
        return TCPStore(
            host_name=host,
            port=port,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception as e:
        if cut.is_set():
            # c10d's own message ("Failed to recv, ...") carries a C++ stack of no use here.
            raise _UnansweredConnection(
                f"the store at {host}:{port} accepted the connection and did not answer it "
                f"by the connection's timeout (is its host frozen?); cut: {_first_line(e)}"
            ) from None
        raise
    finally:
        ended.set()
