"""``torchheal launch``: run N replica groups of your training command locally, with failures.

    torchheal launch --replicas 3 --kill-every 30s -- python train.py --lr 0.1

Starts a lighthouse in this process (or uses ``--lighthouse``), runs the command once per replica
group with ``TORCHHEAL_LIGHTHOUSE``, ``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS`` set, prefixes
each line of output with its group, restarts any group that dies, and — with ``--kill-every`` —
SIGKILLs a group (never group 0) at that interval to show that training survives.
"""

from __future__ import annotations

import argparse
import re
import sys

from torchheal.launcher import KillPlan, Launcher

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str) -> float:
    """Seconds in ``text`` such as ``30s``, ``1.5m``, ``500ms`` or ``12`` (seconds)."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 30s, 2m, 500ms)")
    value = float(m.group(1)) * _UNIT_S[m.group(2)]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"duration must be positive: {text!r}")
    return value


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--replicas", type=int, default=2, help="replica groups to run (default %(default)s)"
    )
    parser.add_argument(
        "--kill-every",
        type=parse_duration,
        default=None,
        help="SIGKILL one group at this interval, e.g. 30s",
    )
    parser.add_argument(
        "--restart-delay",
        type=parse_duration,
        default=1.0,
        help="downtime of a killed group (default 1s)",
    )
    parser.add_argument(
        "--lighthouse", default=None, help="use this lighthouse instead of starting one"
    )
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="min_replicas of the started lighthouse"
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
        "--deadline",
        type=parse_duration,
        default=24 * 3600.0,
        help="end everything after this long",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the training command, after --")
    return parser


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("torchheal launch: give the training command after --", file=sys.stderr)
        return 2
    lighthouse = None
    addr = args.lighthouse
    if addr is None:
        from torchheal.coordination import LighthouseServer

        lighthouse = LighthouseServer(
            bind="127.0.0.1:0",
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
        addr = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
        print(f"[launch] lighthouse at {addr}", flush=True)

    def output(group: int, line: str) -> None:
        print(f"[group {group}] {line}", flush=True)

    def kill(group: int, reason: str) -> None:
        print(f"[launch] SIGKILL group {group} ({reason})", flush=True)

    launcher = Launcher(
        command,
        replicas=args.replicas,
        lighthouse_addr=addr,
        kill_plan=KillPlan(every_s=args.kill_every),
        restart_delay_s=args.restart_delay,
        deadline_s=args.deadline,
        on_output=output,
        on_kill=kill,
    )
    try:
        result = launcher.run()
    except KeyboardInterrupt:
        return 130
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    return 1 if result.timed_out else 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(
        argparse.ArgumentParser(prog="torchheal launch", description=__doc__.split("\n\n")[0])
    )
    return run(parser.parse_args(argv))
