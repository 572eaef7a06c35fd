"""``torchheal lighthouse``: run the job's lighthouse until interrupted.

    torchheal lighthouse --min_replicas 2 --join_timeout_ms 10000

Flags and defaults are the reference's ``torchft_lighthouse`` ones (underscore spellings), with
dash spellings accepted too. Logs every change of the quorum status and every issued quorum to
stderr; SIGINT or SIGTERM stops it cleanly with exit code 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType

__all__ = ["build_parser", "main", "run"]

logger: logging.Logger = logging.getLogger("torchheal.lighthouse")


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the lighthouse options to ``parser``.

    Args:
        parser: the (sub)parser to fill.

    Returns:
        ``parser``.
    """
    parser.description = (
        "Run the lighthouse: every replica group of a training job connects to it (set "
        "TORCHHEAL_LIGHTHOUSE=http://<this host>:<port> in the trainers). Each step it decides "
        "which replica groups take part (the quorum), so training goes on when a group dies and "
        "a returning group is healed from a healthy one."
    )
    parser.add_argument(
        "--min_replicas",
        "--min-replicas",
        dest="min_replicas",
        type=int,
        required=True,
        help="fewest replica groups needed to start a new quorum (required)",
    )
    parser.add_argument(
        "--join_timeout_ms",
        "--join-timeout-ms",
        dest="join_timeout_ms",
        type=int,
        default=60000,
        help="how long to wait for heartbeating stragglers to join before issuing a quorum "
        "without them (default: %(default)s)",
    )
    parser.add_argument(
        "--quorum_tick_ms",
        "--quorum-tick-ms",
        dest="quorum_tick_ms",
        type=int,
        default=100,
        help="how often to re-evaluate waiting quorum requests (default: %(default)s)",
    )
    parser.add_argument(
        "--heartbeat_timeout_ms",
        "--heartbeat-timeout-ms",
        dest="heartbeat_timeout_ms",
        type=int,
        default=5000,
        help="a replica group silent for this long is considered dead (default: %(default)s)",
    )
    parser.add_argument(
        "--bind",
        default="[::]:29510",
        help="address to listen on; port 0 picks a free port (default: %(default)s)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM.

    Args:
        args: parsed options from :func:`build_parser`.

    Returns:
        0 after a clean stop, 2 when the options are invalid or the address cannot be bound.
    """
    # Imported here so that building the parser (for --help) stays cheap.
    from torchheal.coordination.lighthouse import LighthouseServer

    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server = LighthouseServer(
                bind=args.bind,
                min_replicas=args.min_replicas,
                join_timeout_ms=args.join_timeout_ms,
                quorum_tick_ms=args.quorum_tick_ms,
                heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            )
        except (ValueError, RuntimeError) as e:
            print(f"torchheal lighthouse: {e}", file=sys.stderr)
            return 2
        # A stable line on stdout for scripts and launchers that need the address.
        print(f"torchheal lighthouse: serving on {server.address()}", flush=True)
        try:
            # A timed wait keeps the main thread responsive to signals on every platform.
            while not stop.wait(1.0):
                pass
        finally:
            server.shutdown()
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """Run ``torchheal lighthouse`` directly (``python -m torchheal.cli.lighthouse``).

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The process exit code.
    """
    parser = build_parser(argparse.ArgumentParser(prog="torchheal lighthouse"))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
