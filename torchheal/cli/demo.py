"""``torchheal demo``: three local replica groups, one SIGKILLed mid-run, healed live.

Exit code 0 when training survived the failure and every group ended with bit-identical weights.
"""

from __future__ import annotations

import argparse

from torchheal.launcher.demo.run import DemoConfig, run_demo


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
    return parser


def run(args: argparse.Namespace) -> int:
    config = DemoConfig(
        replicas=args.replicas,
        steps=args.steps,
        kill_at_step=args.kill_at_step,
        step_delay_s=args.step_delay,
    )
    try:
        config.validate()
    except ValueError as e:
        print(f"torchheal demo: {e}")
        return 2
    result, summary = run_demo(config)
    ok = not result.timed_out and summary.identical and summary.failures >= 1
    return 0 if ok else 1
