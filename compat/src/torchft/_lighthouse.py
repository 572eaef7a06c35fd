"""The ``torchft_lighthouse`` command of the compat distribution: ``torchheal lighthouse``.

Accepts the reference command's flags (``--min_replicas``, ``--join_timeout_ms``,
``--quorum_tick_ms``, ``--heartbeat_timeout_ms``, ``--bind``) with the same defaults.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Runs torchheal's lighthouse with the reference command's arguments.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The process exit code.
    """
    from torchheal.cli import main as torchheal_main

    args = sys.argv[1:] if argv is None else list(argv)
    return torchheal_main(["lighthouse", *args])


if __name__ == "__main__":
    sys.exit(main())
