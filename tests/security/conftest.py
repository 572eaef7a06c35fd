"""Fixtures of the security tests: a throwaway PKI, and the job's settings in the environment.

Servers and clients read the token and TLS files from the environment when they are created
(``SecurityEnv.from_env``), as in a real job; each test sets what it needs with ``monkeypatch``,
so nothing leaks into other tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.security.pki import Pki, make_pki

TOKEN = "job-s3cret-token"
SECURITY_VARS = (
    "TORCHHEAL_TOKEN",
    "TORCHHEAL_TOKEN_FILE",
    "TORCHHEAL_CHECKPOINT_TOKEN",
    "TORCHHEAL_TLS_CERT",
    "TORCHHEAL_TLS_KEY",
    "TORCHHEAL_TLS_CA",
    "TORCHHEAL_METRICS_AUTH",
)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def job_env(monkeypatch: pytest.MonkeyPatch, pki: Pki) -> Callable[..., None]:
    """``job_env(token=..., tls=...)`` sets the job's security variables (and clears others)."""
    for name in SECURITY_VARS:
        monkeypatch.delenv(name, raising=False)

    def apply(token: str | None = TOKEN, tls: bool = False, ca: Path | None = None) -> None:
        for name in SECURITY_VARS:
            monkeypatch.delenv(name, raising=False)
        if token is not None:
            monkeypatch.setenv("TORCHHEAL_TOKEN", token)
        if tls:
            monkeypatch.setenv("TORCHHEAL_TLS_CERT", str(pki.cert))
            monkeypatch.setenv("TORCHHEAL_TLS_KEY", str(pki.key))
            monkeypatch.setenv("TORCHHEAL_TLS_CA", str(ca or pki.ca))

    return apply
