"""Parsing of ``host:port/prefix`` store addresses and creation of prefixed TCPStore clients."""

from __future__ import annotations

from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore


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


def create_store_client(store_addr: str, timeout: timedelta) -> Store:
    """Connects to an existing TCPStore and scopes it under the address's prefix.

    Args:
        store_addr: ``"host:port/prefix"`` (``"[v6addr]:port/prefix"`` for IPv6).
        timeout: connect and per-operation timeout of the store client.

    Returns:
        ``PrefixStore(prefix, TCPStore(host, port, is_master=False, ...))``.
    """
    host, port, prefix = parse_store_addr(store_addr)
    store = TCPStore(
        host_name=host,
        port=port,
        is_master=False,
        wait_for_workers=False,
        timeout=timeout,
    )
    return PrefixStore(prefix, store)
