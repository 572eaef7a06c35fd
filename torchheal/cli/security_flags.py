"""The security flags every ``torchheal`` command shares: ``--token-file`` and ``--tls-*``.

Each flag stands for its environment variable (``docs/security.md``). The token itself is never
a flag: a command line is visible to every user in ``ps``.
"""

from __future__ import annotations

import argparse

from torchheal._base.security import SecurityEnv, SecurityFlags

__all__ = ["add_security_flags", "security_settings"]


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--token-file``, ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` to ``parser``."""
    group = parser.add_argument_group(
        "security", "job token and TLS (default: the TORCHHEAL_TOKEN*/TORCHHEAL_TLS_* variables)"
    )
    group.add_argument(
        "--token-file",
        "--token_file",
        dest="token_file",
        default=None,
        metavar="PATH",
        help="file holding the job token every endpoint requires (sets TORCHHEAL_TOKEN_FILE)",
    )
    group.add_argument(
        "--tls-cert",
        "--tls_cert",
        dest="tls_cert",
        default=None,
        metavar="PEM",
        help="certificate chain the servers present; turns TLS on (sets TORCHHEAL_TLS_CERT)",
    )
    group.add_argument(
        "--tls-key",
        "--tls_key",
        dest="tls_key",
        default=None,
        metavar="PEM",
        help="private key of --tls-cert (sets TORCHHEAL_TLS_KEY)",
    )
    group.add_argument(
        "--tls-ca",
        "--tls_ca",
        dest="tls_ca",
        default=None,
        metavar="PEM",
        help="authorities clients verify servers with; turns TLS on (sets TORCHHEAL_TLS_CA)",
    )


def security_settings(args: argparse.Namespace) -> tuple[SecurityEnv, dict[str, str]]:
    """The ``SecurityEnv`` the flags give, and a copy of this process's environment with the
    flags in place of their variables, for the processes the command starts.

    Raises:
        ValueError: the settings are invalid; the message names the variable.
    """
    flags = SecurityFlags(
        token_file=getattr(args, "token_file", None),
        tls_cert=getattr(args, "tls_cert", None),
        tls_key=getattr(args, "tls_key", None),
        tls_ca=getattr(args, "tls_ca", None),
    )
    environ = flags.environment()
    return SecurityEnv.from_env(environ), environ
