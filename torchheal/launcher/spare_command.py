"""Which ranks a warm spare can become: the command as Python reads it, and start-up variables.

A spare runs the rank's script or module in an interpreter started earlier, so the rank must
use the same interpreter and options. Variables read once at start-up or import (``PYTHON*``,
locale, ``LD_*``, thread pools', a few of torch's) cannot change later: a rank whose
environment differs in one starts cold. Those read lazily (``NCCL_*``, ...) are taken on.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "STARTUP_NAMES",
    "STARTUP_PREFIXES",
    "PythonCommand",
    "parse_python_command",
    "resolve_interpreter",
    "startup_differences",
]

#: Variables read only when the interpreter starts or a preloaded module is imported.
STARTUP_PREFIXES = ("PYTHON", "LC_", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "MALLOC_")
STARTUP_NAMES = frozenset(
    {"LANG", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES"}
)

_PYTHON = re.compile(r"python[0-9.]*")
_FLAGS = re.compile(r"-[bBdEIOPqsSuv]+")  # interpreter options without an argument


@dataclass(frozen=True)
class PythonCommand:
    """A Python command split the way the interpreter reads it.

    Args:
        interpreter: the interpreter and its options (``python -u -X dev``).
        kind: "path" (a script), "module" (``-m``) or "code" (``-c``).
        target: the script's path, the module or the code.
        args: the arguments after it (``sys.argv[1:]``).
    """

    interpreter: tuple[str, ...]
    kind: str
    target: str
    args: tuple[str, ...]


def parse_python_command(argv: Sequence[str]) -> PythonCommand | None:
    """Splits ``argv`` when it runs a Python script, module or code; None otherwise.

    Interpreter options other than simple flags, ``-W`` and ``-X`` give None too: such
    commands always start cold.
    """
    if not argv or not _PYTHON.fullmatch(os.path.basename(argv[0])):
        return None
    options = [argv[0]]
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg[:2] in ("-m", "-c"):
            kind = "module" if arg[1] == "m" else "code"
            if len(arg) > 2:
                return PythonCommand(tuple(options), kind, arg[2:], tuple(argv[i + 1 :]))
            if i + 1 >= len(argv):
                return None
            return PythonCommand(tuple(options), kind, argv[i + 1], tuple(argv[i + 2 :]))
        if not arg.startswith("-"):
            return PythonCommand(tuple(options), "path", arg, tuple(argv[i + 1 :]))
        if arg in ("-W", "-X"):
            if i + 1 >= len(argv):
                return None
            options += argv[i : i + 2]
            i += 2
            continue
        if arg[:2] in ("-W", "-X") or _FLAGS.fullmatch(arg):
            options.append(arg)
            i += 1
            continue
        return None
    return None


def startup_differences(spare_env: Mapping[str, str], env: Mapping[str, str]) -> list[str]:
    """Sorted names of the start-up variables whose values differ between a spare's and a
    rank's environment; empty when the spare can become this rank."""
    names = set(spare_env) | set(env)
    return sorted(
        n
        for n in names
        if (n.startswith(STARTUP_PREFIXES) or n in STARTUP_NAMES) and spare_env.get(n) != env.get(n)
    )


def resolve_interpreter(interpreter: Sequence[str], env: Mapping[str, str]) -> tuple[str, ...]:
    """The interpreter as the OS would find it in ``env``'s PATH, with its options."""
    program = interpreter[0]
    if os.sep not in program:
        program = shutil.which(program, path=env.get("PATH", os.defpath)) or program
    return (os.path.abspath(program), *interpreter[1:])
