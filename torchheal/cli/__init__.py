"""The ``torchheal`` command: a thin dispatcher to one module per subcommand.

    torchheal lighthouse --min_replicas 2      # run the job's lighthouse
    torchheal launch --replicas 3 -- python train.py
    torchheal status lighthouse-host:29511      # one screen about a running job

Adding a subcommand: write ``torchheal/cli/<name>.py`` with ``build_parser(parser) -> parser``
and ``run(args) -> int`` (the exit code), then add one line to :data:`COMMANDS`. Only the
chosen subcommand's module is imported, so ``torchheal --help`` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata

__all__ = ["COMMANDS", "main"]

# name -> (module, one-line help).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "torchheal.cli.demo",
        "watch fault tolerance work: 3 local replica groups, one killed mid-run and healed live",
    ),
    "lighthouse": (
        "torchheal.cli.lighthouse",
        "run the job's lighthouse, the server that decides which replica groups train each step",
    ),
    "launch": (
        "torchheal.cli.launch",
        "run N replica groups of a training command locally, optionally killing some",
    ),
    "status": (
        "torchheal.cli.status",
        "one screen about a running job (members, steps, rates, failures) from its lighthouse",
    ),
}


def _version() -> str:
    try:
        return metadata.version("torchheal")
    except metadata.PackageNotFoundError:
        return "unknown"


def _chosen_command(argv: list[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``torchheal`` console script; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="torchheal",
        description="Per-step fault tolerance for PyTorch training.",
        epilog="Run 'torchheal COMMAND --help' for the options of a command.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"torchheal {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _chosen_command(argv)
    module = None
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.build_parser(sub)
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help(sys.stderr)
        return 2
    return int(module.run(args))
