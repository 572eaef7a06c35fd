"""Parsing of ``host:port/prefix`` store addresses and creation of prefixed TCPStore clients."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore

#: Longest single connection attempt of :func:`create_store_client` when it can be abandoned.
#: c10d's client retries a connection that failed (one cut to abandon it, say) until its
#: timeout, so only attempts this short let an abandon take effect soon.
CONNECT_ATTEMPT_S = 1.0


class StoreConnectAbandoned(RuntimeError):
    """A store connection in progress was abandoned (see :func:`create_store_client`)."""


def parse_store_addr(store_addr: str) -> tuple[str, int, str]:
    """Splits ``"host:port/prefix"`` into its parts; IPv6 hosts may be bracketed.

    The prefix is everything after the first ``/``; the port is after the last ``:`` of what
    precedes it, so ``[::1]:1234/a/b`` gives ``("::1", 1234, "a/b")``.

    Args:
        store_addr: the address, for example ``"localhost:29500/torchft/3/0"``.

    Raises:
        ValueError: naming the address when it has no prefix, no port, or a bad port.
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

    Args:
        store_addr: ``"host:port/prefix"`` (``"[v6addr]:port/prefix"`` for IPv6).
        timeout: connect and per-operation timeout of the store client.
        abandoned: set from another thread to give the connection up. A host that accepts
            and never answers (a frozen process: its kernel accepts) holds an attempt until its
            connection is cut, and c10d's client then tries again until its timeout. So with
            this event the connection is made in attempts of at most
            :data:`CONNECT_ATTEMPT_S`, and once the event is set the first attempt that fails
            ends it. A connection that succeeds is kept, the event set or not.

    Returns:
        ``PrefixStore(prefix, TCPStore(host, port, is_master=False, ...))``.

    Raises:
        StoreConnectAbandoned: ``abandoned`` was set and an attempt failed.
        torch.distributed.DistError: no connection within ``timeout``.
    """
    host, port, prefix = parse_store_addr(store_addr)
    if abandoned is None:
        return PrefixStore(prefix, _client(host, port, timeout))
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        attempt = min(CONNECT_ATTEMPT_S, deadline - time.monotonic())
        try:
            store = _client(host, port, timedelta(seconds=max(attempt, 0.001)))
        except Exception as e:
            if abandoned.is_set():
                raise StoreConnectAbandoned(
                    f"the connection to the store at {host}:{port} was abandoned"
                ) from e
            if time.monotonic() >= deadline:
                raise
            continue
        store.set_timeout(timeout)
        return PrefixStore(prefix, store)


def _client(host: str, port: int, timeout: timedelta) -> TCPStore:
    return TCPStore(
        host_name=host, port=port, is_master=False, wait_for_workers=False, timeout=timeout
    )
