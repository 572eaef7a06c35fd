"""Addresses and gRPC timeout headers: parsing and formatting, no I/O.

Every server and client of torchheal accepts ``http://host:port``, ``host:port`` and
``[v6addr]:port``; :func:`parse_address` is the one parser, :func:`format_target` the one
way back to a gRPC target.
"""

from __future__ import annotations

import re

__all__ = ["format_target", "parse_address", "parse_grpc_timeout"]


def parse_address(addr: str) -> tuple[str, int]:
    """Split an address into host and port.

    Accepts ``host:port`` and ``[v6addr]:port``, with or without ``http://`` or ``https://``
    (TLS is the security settings' choice, not the scheme's) and a trailing ``/``. Returns an
    IPv6 host without brackets; ``ValueError`` for anything else.
    """
    if not isinstance(addr, str):
        raise ValueError(f"address must be a string, got {type(addr).__name__}")
    rest = addr.strip()
    if "://" in rest:
        scheme, _, rest = rest.partition("://")
        if scheme not in ("http", "https"):  # https: TLS is on (docs/security.md)
            raise ValueError(f"unsupported scheme {scheme!r} in address {addr!r}; use http://")
    rest = rest.rstrip("/")
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0 or rest[close + 1 : close + 2] != ":":
            raise ValueError(f"invalid address {addr!r}: expected [ipv6]:port")
        host, port_text = rest[1:close], rest[close + 2 :]
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep:
            raise ValueError(f"invalid address {addr!r}: expected host:port")
        if ":" in host:
            raise ValueError(f"invalid address {addr!r}: put an IPv6 host in brackets, [::1]:port")
    if not host:
        raise ValueError(f"invalid address {addr!r}: missing host")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"invalid address {addr!r}: port must be an integer in 0..65535")
    return host, int(port_text)


def format_target(host: str, port: int) -> str:
    """Join host and port into a gRPC target, bracketing IPv6 hosts."""
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


_GRPC_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_GRPC_TIMEOUT_RE = re.compile(r"([0-9]{1,8})([HMSmun])")


def parse_grpc_timeout(value: str) -> float:
    """Parse a ``grpc-timeout`` header value (at most 8 digits and a unit) into seconds.

    E.g. ``"100m"`` (100 ms), ``"5S"``, ``"1H"``. gRPC parses the header before our handlers
    run; this is for tools and tests that deal with raw headers.
    """
    match = _GRPC_TIMEOUT_RE.fullmatch(value)
    if match is None:
        raise ValueError(
            f"invalid timeout {value!r}: expected up to 8 digits and a unit H/M/S/m/u/n"
        )
    return int(match.group(1)) * _GRPC_TIMEOUT_UNITS[match.group(2)]
