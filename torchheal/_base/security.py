"""Who may talk to torchheal's endpoints, and over what: the job token and TLS (docs/security.md).

* :func:`job_token`, :class:`SecurityEnv` - the job token and TLS files of every endpoint.
* :func:`checkpoint_token` - the shared secret of the HTTP checkpoint transport.
* :class:`SecurityFlags` - a command line's ``--token-file``/``--tls-*`` flags, applied to an
  environment that the command's settings are read from and its child processes start with.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from torchheal._base.env import OFF, source

#: The HTTP checkpoint transport's shared secret (torchheal only; the reference has none).
CHECKPOINT_TOKEN_ENV: str = "TORCHHEAL_CHECKPOINT_TOKEN"
#: The job's shared secret, required on every torchheal endpoint when set (docs/security.md).
JOB_TOKEN_ENV: str = "TORCHHEAL_TOKEN"
#: A file holding the job token (kept out of ``ps`` and of the environment of every process).
TOKEN_FILE_ENV: str = "TORCHHEAL_TOKEN_FILE"


def job_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The job token: ``TORCHHEAL_TOKEN``, or the contents of ``TORCHHEAL_TOKEN_FILE``.

    None when neither is set. Surrounding white space is stripped; a token is printable ASCII
    without spaces, so that it fits an HTTP header and gRPC metadata as is.
    """
    env = source(environ)
    value = env.get(JOB_TOKEN_ENV, "").strip()
    path = env.get(TOKEN_FILE_ENV, "").strip()
    if value and path:
        raise ValueError(f"set {JOB_TOKEN_ENV} or {TOKEN_FILE_ENV}, not both")
    name = JOB_TOKEN_ENV
    if path:
        name = f"{TOKEN_FILE_ENV}={path!r}"
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{name}: cannot read the token file: {e}") from None
        if not value:
            raise ValueError(f"{name}: the token file is empty")
    return _checked_token(name, value) if value else None


def _checked_token(name: str, value: str) -> str:
    # Sent as is in an HTTP header and gRPC metadata: a control character there fails every
    # request (or, inside the value, could split the header), so refuse it at start-up.
    if not all("!" <= c <= "~" for c in value):
        raise ValueError(f"{name}: the token must be printable ASCII without spaces")
    return value


def checkpoint_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The HTTP checkpoint transport's shared secret, or None.

    ``TORCHHEAL_CHECKPOINT_TOKEN`` (its older, transport-only name) when set, else the job
    token (:func:`job_token`), checked the same way.
    """
    env = source(environ)
    override = _checkpoint_override(env)
    return override if override is not None else job_token(env)


def _checkpoint_override(env: Mapping[str, str]) -> str | None:
    value = env.get(CHECKPOINT_TOKEN_ENV, "").strip()
    return _checked_token(CHECKPOINT_TOKEN_ENV, value) if value else None


#: PEM certificate chain a server presents (with :data:`TLS_KEY_ENV`); setting it turns TLS on.
TLS_CERT_ENV: str = "TORCHHEAL_TLS_CERT"
#: PEM private key of that certificate.
TLS_KEY_ENV: str = "TORCHHEAL_TLS_KEY"
#: PEM bundle of the certificate authorities a client trusts; setting it turns TLS on.
TLS_CA_ENV: str = "TORCHHEAL_TLS_CA"
#: ``1``/``true``: ``/metrics`` needs the job token too (default: open, as Prometheus expects).
METRICS_AUTH_ENV: str = "TORCHHEAL_METRICS_AUTH"


@dataclass(frozen=True)
class SecurityEnv:
    """Who may talk to torchheal's endpoints, and over what: read from the environment.

    With nothing set, every endpoint speaks the reference's plain wire (no token, no TLS).
    Built once at an edge and passed down to the I/O code.

    Attributes:
        token: the job token every server requires and every client sends (:func:`job_token`).
        tls_cert: the certificate chain servers present (PEM path).
        tls_key: its private key (PEM path).
        tls_ca: the authorities clients verify servers with (PEM path); None with TLS on: the
            system's defaults.
        metrics_auth: ``/metrics`` requires the token as well.
        checkpoint_token: the checkpoint transport's own secret (None: the job token).
    """

    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    metrics_auth: bool = False
    checkpoint_token: str | None = None

    @property
    def transport_token(self) -> str | None:
        """The HTTP checkpoint transport's secret: its own, else the job token."""
        return self.checkpoint_token if self.checkpoint_token is not None else self.token

    @property
    def tls(self) -> bool:
        """Whether TLS is on (a certificate or an authority bundle is configured)."""
        return self.tls_cert is not None or self.tls_ca is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SecurityEnv:
        """Reads and validates the variables (a certificate needs its key, files must exist)."""
        env = source(environ)
        paths: dict[str, str | None] = {}
        for field, name in (
            ("tls_cert", TLS_CERT_ENV),
            ("tls_key", TLS_KEY_ENV),
            ("tls_ca", TLS_CA_ENV),
        ):
            value = env.get(name, "").strip()
            if value and not os.path.isfile(value):
                raise ValueError(f"{name}={value!r}: no such file")
            paths[field] = value or None
        if (paths["tls_cert"] is None) != (paths["tls_key"] is None):
            raise ValueError(f"set {TLS_CERT_ENV} and {TLS_KEY_ENV} together")
        return cls(
            token=job_token(env),
            metrics_auth=env.get(METRICS_AUTH_ENV, "").strip().lower() not in OFF,
            checkpoint_token=_checkpoint_override(env),
            **paths,
        )


@dataclass(frozen=True)
class SecurityFlags:
    """A command line's security flags (``--token-file``, ``--tls-*``); None: not given.

    :meth:`environment` applies them to a copy of an environment, which the command reads its
    settings from and starts its children with: they see a token path, never the token (out
    of ``ps``). ``token_file`` replaces ``TORCHHEAL_TOKEN``. This process's environment is
    never written.
    """

    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    def environment(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """A copy of ``environ`` (``os.environ`` when None) with each flag given in place of its
        variable."""
        env = dict(source(environ))
        if self.token_file is not None:
            env.pop(JOB_TOKEN_ENV, None)
            env[TOKEN_FILE_ENV] = self.token_file
        for name, value in (
            (TLS_CERT_ENV, self.tls_cert),
            (TLS_KEY_ENV, self.tls_key),
            (TLS_CA_ENV, self.tls_ca),
        ):
            if value is not None:
                env[name] = value
        return env
