"""``torchheal status [ADDR]``: one terminal screen about a running job, from its lighthouse.

    torchheal status                         # the dashboard on localhost:29511
    torchheal status lighthouse-host:29511 --watch 2

Reads the lighthouse dashboard's ``/api/status`` (the web page's document) and prints it as
text, or as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import ssl
import sys
import threading
import urllib.error
import urllib.request
from typing import Any

__all__ = ["build_parser", "fetch_status", "run"]

DEFAULT_ADDR = "localhost:29511"


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the status options to ``parser`` and return it."""
    parser.add_argument(
        "addr",
        nargs="?",
        default=None,
        help=f"the lighthouse dashboard, host:port or http://host:port (default: {DEFAULT_ADDR})",
    )
    parser.add_argument(
        "--watch",
        type=float,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS until interrupted",
    )
    parser.add_argument("--json", action="store_true", help="print the status document as JSON")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for an answer (default: 5)"
    )
    from torchheal.cli.security_flags import add_security_flags

    add_security_flags(parser)
    return parser


def _url(addr: str, tls: bool = False) -> str:
    addr = addr.strip().rstrip("/")
    if "://" not in addr:
        addr = ("https://" if tls else "http://") + addr
    return addr + "/api/status"


def fetch_status(
    addr: str, timeout: float = 5.0, context: ssl.SSLContext | None = None
) -> dict[str, Any]:
    """The status document of the lighthouse dashboard at ``addr`` (``host:port`` or a URL).

    With a TLS ``context`` a bare ``host:port`` means ``https``.

    Raises:
        RuntimeError: the dashboard could not be reached or answered something else.
    """
    url = _url(addr, context is not None)
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url} answered HTTP {e.code}: {e.read()[:200]!r}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise RuntimeError(
            f"cannot reach the lighthouse dashboard at {url}: {reason}. Is the lighthouse "
            "running, and is this its dashboard port (printed as 'dashboard: ...' at start-up)?"
        ) from None
    except ValueError as e:
        raise RuntimeError(f"{url} did not answer a status document: {e}") from None


def run(args: argparse.Namespace) -> int:
    """Print the status once, or every ``--watch`` seconds: 0 on success, 1 when the dashboard
    cannot be read, 2 on bad options."""
    from torchheal.cli.security_flags import security_settings
    from torchheal.coordination.lighthouse.dashboard.terminal import render
    from torchheal.coordination.rpc.tls import client_ssl_context

    addr = args.addr or DEFAULT_ADDR
    try:
        security, _ = security_settings(args)
        context = client_ssl_context(security) if security.tls else None
    except (ValueError, RuntimeError) as e:
        print(f"torchheal status: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    while True:
        try:
            doc = fetch_status(addr, args.timeout, context)
        except RuntimeError as e:
            print(f"torchheal status: {e}", file=sys.stderr)
            if args.watch is None:
                return 1
            doc = None
        if doc is not None:
            if args.json:
                text = json.dumps(doc, indent=2)
            else:
                text = render(doc, width=shutil.get_terminal_size((120, 40)).columns)
            if args.watch is not None and sys.stdout.isatty():
                sys.stdout.write("\033[H\033[2J")  # clear the screen before each redraw
            print(text, flush=True)
        if args.watch is None:
            return 0
        try:
            stop.wait(args.watch)
        except KeyboardInterrupt:
            return 0
