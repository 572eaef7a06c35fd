"""The process side of a warm spare: import first, then become the rank it is handed.

    python [options] -m torchheal.launcher.spare_child --ready-fd N [--preload MOD ...]

It imports the ``--preload`` modules (at idle CPU priority, ``spare_priority.py``), writes
``{"ready": true, "missing": [...], "s": seconds}`` on fd ``N``, then reads the hand-over from
stdin (``{"kind": "path"|"module", "target": ..., "argv": [...], "env": {...}, "cwd": ...}``),
takes on its directory, environment, stdin, ``sys.argv`` and ``sys.path[0]``, and runs the
script as ``__main__``: from there it *is* the rank (same pid, exit status and output pipe).
Only JSON crosses the pipe; ``-c CODE`` is never handed over (it would mean ``exec``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys
import time
import traceback
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from torchheal.launcher.spare_priority import Priority

#: Longest hand-over line read from stdin (an environment is a few KiB; this bounds a bad one).
MAX_HANDOVER_BYTES = 16 * 1024 * 1024


def preload(modules: list[str]) -> list[str]:
    """Imports ``modules``; returns those that failed (``module: error``), best effort."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # a spare that cannot preload is still a spare
            missing.append(f"{name}: {type(e).__name__}: {e}")
    return missing


def _read_line(fd: int) -> bytes:
    """One line from ``fd``, read unbuffered so nothing beyond it is consumed."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            break  # the launcher went away before handing anything over
        data += chunk
        if len(data) > MAX_HANDOVER_BYTES:
            raise ValueError(f"hand-over line longer than {MAX_HANDOVER_BYTES} bytes")
    return bytes(data)


def _handover(raw: bytes) -> dict[str, Any]:
    msg = json.loads(raw)
    if not isinstance(msg, dict) or msg.get("kind") not in ("path", "module"):
        raise ValueError(f"bad hand-over: {raw[:200]!r}")
    env, argv = msg.get("env"), msg.get("argv")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError("bad hand-over: env must map strings to strings")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise ValueError("bad hand-over: argv must be a list of strings")
    if not isinstance(msg.get("target"), str) or not isinstance(msg.get("cwd"), str):
        raise ValueError("bad hand-over: target and cwd must be strings")
    return msg


def take_environment(env: Mapping[str, str]) -> None:
    """Replaces this process's environment with the rank's whole ``env``.

    The one write of ``os.environ`` in torchheal: this process *is* the rank from here on.
    """
    os.environ.clear()
    os.environ.update(env)


def _become(msg: dict[str, Any]) -> None:
    """Takes on the rank's identity (see the module docstring)."""
    os.chdir(msg["cwd"])
    take_environment(msg["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    target = msg["target"]
    sys.argv = [target, *msg["argv"]]
    # What the interpreter puts first on sys.path: the script's directory, or for -m the
    # working directory.
    first = os.path.dirname(os.path.abspath(target)) if msg["kind"] == "path" else os.getcwd()
    if sys.path:
        sys.path[0] = first
    else:
        sys.path.insert(0, first)


def _trimmed(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the script's first frame on (without this module's and runpy's)."""
    own = (__file__, runpy.__file__, "<frozen runpy>")
    while tb is not None and tb.tb_frame.f_code.co_filename in own:
        tb = tb.tb_next
    return tb


def _run(msg: dict[str, Any]) -> None:
    try:
        if msg["kind"] == "path":
            runpy.run_path(msg["target"], run_name="__main__")
        else:
            runpy.run_module(msg["target"], run_name="__main__", alter_sys=True)
    except (SystemExit, KeyboardInterrupt):
        raise  # exit status, and death by SIGINT, exactly as the script's
    except BaseException as e:  # report it as the interpreter would
        tb = _trimmed(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """Preload, signal readiness, wait for the hand-over, run the script."""
    parser = argparse.ArgumentParser(prog="torchheal.launcher.spare_child")
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--preload", action="append", default=[])
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    priority = Priority()
    priority.normal_on_handover()
    priority.idle_while_preloading()
    missing = preload(args.preload)
    ready = {
        "ready": True,
        "missing": missing,
        "s": round(time.monotonic() - t0, 3),
        "idle": priority.idle,
    }
    try:
        os.write(args.ready_fd, (json.dumps(ready) + "\n").encode())
        os.close(args.ready_fd)
    except OSError:
        pass  # the pool is gone; the hand-over read below sees its end too
    serve(priority)


def serve(priority: Priority) -> None:
    """Waits for the hand-over on stdin, then becomes the rank and runs its script; exits."""
    try:
        raw = _read_line(0)
    except KeyboardInterrupt:
        sys.exit(130)  # Ctrl-C on the launcher's terminal while idle: leave quietly
    priority.normal()  # (the watcher does it too) from here on this process is a rank
    if not raw.strip():
        sys.exit(0)  # the pool closed without handing anything over
    try:
        msg = _handover(raw)
    except ValueError as e:
        traceback.print_exception(e)
        sys.exit(2)
    _become(msg)
    _run(msg)


if __name__ == "__main__":
    main()
