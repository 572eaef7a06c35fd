"""``torchheal demo``: three local replica groups, one SIGKILLed mid-run, healed live.

Prints the dashboard's URL first, to watch the quorum shrink and grow again; ``--keep-open``
keeps it up after the summary, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import threading

from torchheal.cli.security_flags import add_security_flags, security_settings
from torchheal.launcher.demo.run import DemoConfig, run_demo


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the demo options to ``parser`` and return it."""
    d = DemoConfig()
    parser.add_argument(
        "--replicas",
        type=int,
        default=d.replicas,
        help="replica groups to run (default %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=d.steps,
        help="train until this step commits (default %(default)s)",
    )
    parser.add_argument(
        "--kill-at-step",
        type=int,
        default=d.kill_at_step,
        help="SIGKILL group 1 at this step (default %(default)s)",
    )
    parser.add_argument(
        "--step-delay",
        type=float,
        default=d.step_delay_s,
        help="simulated compute per step, seconds (default %(default)s)",
    )
    parser.add_argument(
        "--warm-spares",
        type=int,
        default=d.warm_spares,
        help="warm spare processes (torch already imported) kept for the restart; 0 restarts "
        "the killed group cold, as torchrun would (default %(default)s)",
    )
    parser.add_argument(
        "--dashboard-port",
        type=int,
        default=None,
        help="port of the dashboard (default: $TORCHHEAL_DASHBOARD_PORT, else 29511, or any free "
        "port when that is taken; 0: any free port)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve each group's Prometheus /metrics from its rank 0 on this port plus the "
        "group index (default: off)",
    )
    parser.add_argument(
        "--keep-open",
        action="store_true",
        help="after the summary, keep the lighthouse and its dashboard up until Ctrl-C",
    )
    add_security_flags(parser)
    return parser


def _wait_for_ctrl_c(url: str) -> None:
    stop = threading.Event()
    try:  # the message inside: a Ctrl-C right after it is still a clean exit
        print(f"\nThe dashboard stays up at {url} ; press Ctrl-C to exit.", flush=True)
        while not stop.wait(1.0):  # a timed wait keeps Ctrl-C responsive
            pass
    except KeyboardInterrupt:
        print("", flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the demo: 0 when training survived the failure with identical weights everywhere,
    1 otherwise, 2 on bad options."""
    from torchheal._base.telemetry_env import dashboard_port

    try:
        # The lighthouse started here gets the settings; the groups, the environment.
        security, environ = security_settings(args)
        port = args.dashboard_port if args.dashboard_port is not None else dashboard_port()
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"--dashboard-port must be in 0..65535, got {port}")
        if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535 - args.replicas:
            raise ValueError(
                f"--metrics-port must leave room for the groups, got {args.metrics_port}"
            )
        config = DemoConfig(
            replicas=args.replicas,
            steps=args.steps,
            kill_at_step=args.kill_at_step,
            step_delay_s=args.step_delay,
            warm_spares=args.warm_spares,
            dashboard_port=port,
            token=security.token,
            security=security,
            environ=environ,
            metrics_port=args.metrics_port,
        )
        config.validate()
    except ValueError as e:
        print(f"torchheal demo: {e}")
        return 2
    try:
        result, summary = run_demo(config, hold=_wait_for_ctrl_c if args.keep_open else None)
    except RuntimeError as e:  # the dashboard's port could not be bound
        print(f"torchheal demo: {e}")
        return 2
    ok = (
        not result.timed_out
        and result.error is None
        and summary.identical
        and summary.failures >= 1
    )
    return 0 if ok else 1
