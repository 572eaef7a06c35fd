"""``torchheal lighthouse``: run the job's lighthouse until interrupted.

    torchheal lighthouse --min_replicas 2 --join_timeout_ms 10000

Flags and defaults are the reference's ``torchft_lighthouse`` ones (underscore spellings; dash
spellings work too). It also serves its dashboard, ``/metrics`` and ``/api/status`` on
``--dashboard_port``. SIGINT or SIGTERM stops it cleanly with exit code 0.
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys
import threading
from types import FrameType

__all__ = ["build_parser", "main", "run"]

logger: logging.Logger = logging.getLogger("torchheal.lighthouse")


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the lighthouse options to ``parser`` and return it."""
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
    parser.add_argument(
        "--dashboard_port",
        "--dashboard-port",
        dest="dashboard_port",
        type=int,
        default=None,
        help="HTTP port of the dashboard, /metrics and /api/status, on the --bind host; 0 picks "
        "a free port (default: $TORCHHEAL_DASHBOARD_PORT, else 29511; 0 when --bind's port is 0)",
    )
    parser.add_argument(
        "--exit_when_idle",
        "--exit-when-idle",
        dest="exit_when_idle",
        type=float,
        default=None,
        metavar="SECONDS",
        help="exit (code 0) once replica groups have joined and then none has been heard from "
        "for SECONDS: the job is over (for launchers such as torchx whose job ends when every "
        "role exits; default: run until interrupted)",
    )
    from torchheal.cli.security_flags import add_security_flags

    add_security_flags(parser)
    from torchheal.cli.lighthouse_store import add_store_flags

    add_store_flags(parser)
    return parser


def _idle(status: dict, seen: bool, idle_s: float) -> tuple[bool, bool]:
    """``(seen any group so far, the job is over)`` from a lighthouse status."""
    ages = status["heartbeats"].values()
    seen = seen or bool(ages) or status["prev_quorum"] is not None
    return seen, seen and all(age >= idle_s for age in ages)


def _dashboard_port(args: argparse.Namespace, bind_port: int) -> int:
    """The flag, else the environment, else 29511 (any free port when the gRPC port is too)."""
    from torchheal._base.telemetry_env import dashboard_port
    from torchheal.coordination.lighthouse.dashboard import DEFAULT_DASHBOARD_PORT

    if args.dashboard_port is not None:
        if not 0 <= args.dashboard_port <= 65535:
            raise ValueError(f"--dashboard_port must be in 0..65535, got {args.dashboard_port}")
        return args.dashboard_port
    from_env = dashboard_port()
    if from_env is not None:
        return from_env
    return 0 if bind_port == 0 else DEFAULT_DASHBOARD_PORT


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM: 0 after a clean stop, 2 on invalid options or an address
    that cannot be bound."""
    # Imported here so that building the parser (for --help) stays cheap.
    from torchheal.cli.security_flags import security_settings
    from torchheal.coordination.lighthouse.dashboard import DashboardServer, LighthouseRecorder
    from torchheal.coordination.lighthouse.dashboard.server import kill_replica
    from torchheal.coordination.lighthouse.server import LighthouseServer
    from torchheal.coordination.rpc.addresses import parse_address

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
        recorder = LighthouseRecorder()
        try:
            security, _ = security_settings(args)
            host, bind_port = parse_address(args.bind)
            port = _dashboard_port(args, bind_port)
            from torchheal.cli.lighthouse_store import open_store

            # A standby (--etcd) waits here until it holds the lease.
            store = open_store(args, stop)
            server = LighthouseServer(
                bind=args.bind,
                min_replicas=args.min_replicas,
                join_timeout_ms=args.join_timeout_ms,
                quorum_tick_ms=args.quorum_tick_ms,
                heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                observer=recorder,
                store=store,
                security=security,
            )
        except (ValueError, RuntimeError) as e:
            print(f"torchheal lighthouse: {e}", file=sys.stderr)
            return 2
        try:
            from torchheal.coordination.rpc.tls import server_ssl_context

            dashboard = DashboardServer(
                server,
                recorder,
                host=host,
                port=port,
                token=security.token,
                metrics_auth=security.metrics_auth,
                ssl_context=server_ssl_context(security, "dashboard") if security.tls else None,
                # The flags' settings are not in this process's environment: pass them on.
                kill=functools.partial(kill_replica, security=security),
            )
        except RuntimeError as e:
            server.shutdown()
            print(f"torchheal lighthouse: {e}", file=sys.stderr)
            return 2
        # Stable lines on stdout for scripts and launchers that need the addresses.
        print(f"torchheal lighthouse: serving on {server.address()}", flush=True)
        wildcard = host in ("::", "0.0.0.0", "")
        print(f"dashboard: {dashboard.url(None if wildcard else host)}", flush=True)
        try:
            # A timed wait keeps the main thread responsive to signals on every platform.
            seen = False
            while not stop.wait(1.0):
                if args.exit_when_idle is not None:
                    seen, over = _idle(server.status(), seen, args.exit_when_idle)
                    if over:
                        logger.info(
                            "no replica group heard from for %ss: the job is over, exiting",
                            args.exit_when_idle,
                        )
                        break
        finally:
            dashboard.shutdown()
            server.shutdown()
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """Run ``torchheal lighthouse`` directly (``python -m torchheal.cli.lighthouse``)."""
    parser = build_parser(argparse.ArgumentParser(prog="torchheal lighthouse"))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
