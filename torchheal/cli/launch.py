"""``torchheal launch``: run N replica groups of your training command locally, with failures.

    torchheal launch --replicas 3 --nproc-per-replica 2 --kill-every 30s -- python train.py --lr 0.1

Starts a lighthouse and its dashboard in this process (or uses ``--lighthouse``) and runs each
replica group as a torchrun-like job of ``--nproc-per-replica`` ranks (``launcher/group.py``).
A group that loses a rank is ended and restarted; a progress line shows the job's step, rate,
quorum and failures, and a report closes the run.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}

__all__ = ["build_parser", "main", "parse_duration", "run"]


def parse_duration(text: str) -> float:
    """Seconds in ``text`` such as ``30s``, ``1.5m``, ``500ms`` or ``12`` (seconds).

    Raises:
        argparse.ArgumentTypeError: not a positive duration.
    """
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 30s, 2m, 500ms)")
    value = float(m.group(1)) * _UNIT_S[m.group(2)]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"duration must be positive: {text!r}")
    return value


def _at_least(low: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def _positive(text: str) -> int:
    return _at_least(1, text)


def _count(text: str) -> int:
    return _at_least(0, text)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text!r} (0..65535)")
    return value


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the launch options to ``parser`` and return it."""
    parser.add_argument(
        "--replicas", type=_positive, default=2, help="replica groups to run (default %(default)s)"
    )
    parser.add_argument(
        "--nproc-per-replica",
        "--nproc_per_replica",
        dest="nproc_per_replica",
        type=_positive,
        default=1,
        help="ranks per replica group, as torchrun's --nproc-per-node (default %(default)s)",
    )
    parser.add_argument(
        "--kill-every",
        type=parse_duration,
        default=None,
        help="SIGKILL one group (never group 0) at this interval, e.g. 30s",
    )
    parser.add_argument(
        "--restart-delay",
        type=parse_duration,
        default=1.0,
        help="downtime of a dead group before its restart (default 1s)",
    )
    parser.add_argument(
        "--warm-spares",
        type=_count,
        default=1,
        help="keep N groups' worth of warm processes (torch and torchheal already imported) "
        "that a restarted group starts in; 0: restarts start cold (default %(default)s)",
    )
    parser.add_argument(
        "--spare-preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module warm spares import too (repeatable), e.g. your model's",
    )
    parser.add_argument(
        "--max-startup-failures",
        type=_positive,
        default=3,
        help="stop when a group dies this many times in a row before its first step "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--lighthouse", default=None, help="use this lighthouse instead of starting one"
    )
    parser.add_argument(
        "--lighthouse-dashboard",
        default=None,
        help="with --lighthouse: its dashboard URL, read for progress (default: the "
        "lighthouse's host on port 29511)",
    )
    parser.add_argument(
        "--dashboard-port",
        type=_port,
        default=None,
        help="port of the started lighthouse's dashboard (default: $TORCHHEAL_DASHBOARD_PORT, "
        "else 29511 or any free port when that is taken)",
    )
    parser.add_argument(
        "--min-replicas", type=_positive, default=1, help="min_replicas of the started lighthouse"
    )
    parser.add_argument(
        "--join-timeout-ms", type=int, default=1000, help="join timeout of the started lighthouse"
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=2000,
        help="heartbeat timeout of the started lighthouse",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve each group's Prometheus /metrics from its rank 0 on this port plus the "
        "group index (sets TORCHHEAL_METRICS_PORT; 0: any free port)",
    )
    parser.add_argument(
        "--deadline",
        type=parse_duration,
        default=24 * 3600.0,
        help="end everything after this long",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after --")
    from torchheal.cli.security_flags import add_security_flags

    add_security_flags(parser)
    return parser


def _external_status(args: argparse.Namespace) -> Any:
    """The status source of an external lighthouse's dashboard, or None when none answers."""
    from urllib.parse import urlsplit

    from torchheal.launcher.progress import fetch_status

    url = args.lighthouse_dashboard
    if url is None:
        target = args.lighthouse if "://" in args.lighthouse else "http://" + args.lighthouse
        host = urlsplit(target).hostname or "localhost"
        url = f"http://{f'[{host}]' if ':' in host else host}:29511/"
    elif "://" not in url:
        url = "http://" + url
    status = fetch_status(url)
    if status() is None:
        print(
            f"[launch] no lighthouse dashboard answers at {url}: progress is not shown, and a "
            "group counts as started once it stayed up 60s (give --lighthouse-dashboard)",
            flush=True,
        )
        return None
    print(f"[launch] dashboard: {url}", flush=True)
    return status


def run(args: argparse.Namespace) -> int:
    """Launch the job and wait for it to end: 0 when every group finished, 1 when the launch
    gave up or ran out of time, 2 on bad options, 130 on Ctrl-C."""
    from torchheal._base.telemetry_env import dashboard_port
    from torchheal.launcher import KillPlan, Launcher
    from torchheal.launcher.group import describe_exit
    from torchheal.launcher.progress import GroupReport, LiveLine, progress_line, render_report

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("torchheal launch: give the training command after --", file=sys.stderr)
        return 2
    from torchheal.cli.security_flags import security_settings

    try:
        # The lighthouse started here gets the settings; the groups, the environment.
        security, environ = security_settings(args)
    except ValueError as e:
        print(f"torchheal launch: {e}", file=sys.stderr)
        return 2
    local = None
    addr = args.lighthouse
    if addr is None:
        from torchheal.launcher.lighthouse import LocalLighthouse

        try:
            port = args.dashboard_port if args.dashboard_port is not None else dashboard_port()
            local = LocalLighthouse(
                min_replicas=args.min_replicas,
                join_timeout_ms=args.join_timeout_ms,
                heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                dashboard_port=port,
                token=security.token,
                security=security,
            )
        except (ValueError, RuntimeError) as e:
            print(f"torchheal launch: {e}", file=sys.stderr)
            return 2
        addr = local.address
        status = local.status
        print(f"[launch] lighthouse at {addr}", flush=True)
        print(f"dashboard: {local.dashboard_url}", flush=True)
    else:
        status = _external_status(args)

    live = LiveLine()
    last: dict[str, Any] = {"doc": None}
    launcher: Launcher | None = None
    t0 = time.time()

    def on_status(doc: dict[str, Any] | None) -> None:
        if doc is not None:
            last["doc"] = doc
        assert launcher is not None
        restarts = sum(max(0, len(g.starts) - 1) for g in launcher.groups.values())
        live.status(progress_line(doc, time.time() - t0, args.replicas, restarts))

    metrics_port = args.metrics_port

    def group_env(group: int) -> dict[str, str]:
        if metrics_port is None:
            return {}
        return {"TORCHHEAL_METRICS_PORT": str(metrics_port + group if metrics_port else 0)}

    launcher = Launcher(
        command,
        replicas=args.replicas,
        lighthouse_addr=addr,
        kill_plan=KillPlan(every_s=args.kill_every),
        restart_delay_s=args.restart_delay,
        deadline_s=args.deadline,
        on_output=lambda g, line: live.print(f"[group {g}] {line}"),
        on_kill=lambda g, reason: live.print(f"[launch] SIGKILL group {g} ({reason})"),
        on_restart=lambda g, code: live.print(
            f"[launch] group {g} ended ({describe_exit(code)}); restarting it in "
            f"{args.restart_delay:g}s"
        ),
        nproc_per_replica=args.nproc_per_replica,
        max_startup_failures=args.max_startup_failures,
        status=status,
        on_status=on_status,
        group_env=group_env,
        warm_spares=args.warm_spares,
        spare_preload=args.spare_preload,
        base_env=environ,
    )
    try:
        result = launcher.run()
    except KeyboardInterrupt:
        live.close()
        return 130
    finally:
        if local is not None:
            final = local.status()
            if final is not None:
                last["doc"] = final
            local.shutdown()
    live.close()
    reports = [
        GroupReport(g.group, len(g.starts), len(g.kills), g.crashes, g.done, g.stopped)
        for g in result.groups.values()
    ]
    print(
        render_report(
            last["doc"],
            reports,
            result.ended - result.started,
            result.error,
            finished=any(g.done for g in result.groups.values()),
        )
    )
    restarts = sum(max(0, len(g.starts) - 1) for g in result.groups.values())
    if restarts:
        warm = sum(g.warm_starts for g in result.groups.values())
        print(f"[launch] restarts from a warm spare: {warm} of {restarts}", flush=True)
    if result.error is not None:
        print(f"torchheal launch: {result.error}", file=sys.stderr)
        return 1
    if result.timed_out:
        print(f"torchheal launch: deadline of {args.deadline:g}s reached", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``torchheal launch`` directly; returns the process exit code."""
    parser = build_parser(
        argparse.ArgumentParser(prog="torchheal launch", description=__doc__.split("\n\n")[0])
    )
    return run(parser.parse_args(argv))
