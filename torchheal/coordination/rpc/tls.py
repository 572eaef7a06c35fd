"""TLS for torchheal's servers and clients: gRPC credentials and ``ssl`` contexts for HTTP.

Paths come from :class:`~torchheal._base.security.SecurityEnv`. A client verifies the server
against the configured authorities (else the system's) and the host name it dialled; clients
present no certificate: the job token is what admits them.
"""

from __future__ import annotations

import ssl

import grpc

from torchheal._base.security import TLS_CERT_ENV, TLS_KEY_ENV, SecurityEnv

__all__ = [
    "channel_credentials",
    "client_ssl_context",
    "server_credentials",
    "server_ssl_context",
]


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise RuntimeError(f"cannot read the TLS {what} {path!r}: {e}") from None


def _require_certificate(security: SecurityEnv, who: str) -> tuple[str, str]:
    if security.tls_cert is None or security.tls_key is None:
        raise RuntimeError(
            f"{who}: TLS is on but this server has no certificate: set {TLS_CERT_ENV} and "
            f"{TLS_KEY_ENV} (or --tls-cert and --tls-key)"
        )
    return security.tls_cert, security.tls_key


def server_credentials(security: SecurityEnv, who: str) -> grpc.ServerCredentials:
    """gRPC server credentials presenting the configured certificate (``RuntimeError`` if
    none is configured or a file cannot be read; ``who`` names the server)."""
    cert, key = _require_certificate(security, who)
    return grpc.ssl_server_credentials([(_read(key, "key"), _read(cert, "certificate"))])


def channel_credentials(security: SecurityEnv) -> grpc.ChannelCredentials:
    """gRPC channel credentials trusting the configured authorities (else the system's)."""
    roots = None if security.tls_ca is None else _read(security.tls_ca, "CA bundle")
    return grpc.ssl_channel_credentials(root_certificates=roots)


def server_ssl_context(security: SecurityEnv, who: str) -> ssl.SSLContext:
    """An ``ssl`` context for an HTTPS server presenting the configured certificate (errors
    as :func:`server_credentials`)."""
    cert, key = _require_certificate(security, who)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise RuntimeError(f"{who}: cannot load the TLS certificate {cert!r}: {e}") from None
    return context


def client_ssl_context(security: SecurityEnv) -> ssl.SSLContext:
    """An ``ssl`` context for an HTTPS client: verifies the server's certificate and name."""
    try:
        context = ssl.create_default_context(cafile=security.tls_ca)
    except (OSError, ssl.SSLError) as e:
        raise RuntimeError(f"cannot load the TLS CA bundle {security.tls_ca!r}: {e}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context
