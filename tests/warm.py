"""Test workers started warm: forked from one template that imported torch once per session.

A suite of real multi-process failures starts some 400 Python processes, and each fresh
interpreter pays ``import torch`` (2.5-3 s of CPU on this 2-core machine): more than half the
suite's CPU time went there. The jobs the tests run (``tests.failfast.job``) start their workers
the way ``torchheal launch --warm-spares`` restarts a group: through the launcher's own
:class:`~torchheal.launcher.spare.SparePool`, which forks each from a template that preloaded
torch and torchheal, then hands it the worker's argv, environment and working directory. The
worker is still a process of its own (its pid, its sockets, its death by SIGKILL), started by
the code users run; only the imports are shared.

:func:`start` runs ``python -m MODULE ARGS`` so, with its stdout (and stderr, merged) on a pipe,
as ``subprocess.Popen(..., stdout=PIPE, stderr=STDOUT, text=True)`` would; its stdin is
``/dev/null`` (a hand-over takes it), so a test talks to a worker some other way (a FIFO).
Where the environment differs from the session's in what only a fresh interpreter reads (see
``spare.py``), the pool starts it cold, as it does for users.

Tests that run a function in a process of its own (``multiprocessing``) take
:func:`mp_context`: the standard library's forkserver, its server preloading the same modules,
instead of the spawn start method, which began a fresh interpreter each time. A child takes on
the environment its parent had at ``Process.start`` (a forkserver's children would otherwise
inherit the server's), but for what only a fresh interpreter reads.

``TORCHHEAL_TESTS_COLD=1`` starts every worker cold and takes spawn for ``multiprocessing``:
the tests then run at the pace of a fresh interpreter, as jobs without warm spares restart.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.context
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from torchheal.launcher.spare import DEFAULT_PRELOAD, SparePool
from torchheal.launcher.spare_child import take_environment

__all__ = ["WORKER_ENV", "mp_context", "start"]

ROOT = Path(__file__).resolve().parents[1]

#: What the workers' environment adds to this process's (one-thread pools, read at start-up).
WORKER_ENV = {"OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}

#: Set to "1": every worker a fresh interpreter (see the module docstring).
COLD = os.environ.get("TORCHHEAL_TESTS_COLD", "") == "1"

_lock = threading.Lock()
_pool: SparePool | None = None


def _session_pool() -> SparePool:
    global _pool
    with _lock:
        if _pool is None:
            _pool = SparePool(
                [sys.executable, "-m", "tests"],
                size=0 if COLD else 1,
                env={**os.environ, **WORKER_ENV},
                cwd=str(ROOT),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            _pool.fill()  # starts the template
            _pool.preparing()  # a test waits for it now: import at normal priority
            atexit.register(_pool.close)
        return _pool


def start(
    module: str, args: Sequence[str], env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """Starts ``python -m module *args`` in the repository's root, warm where it can.

    Args:
        module: the module run as ``__main__``.
        args: its arguments.
        env: its environment (default: this process's now, with :data:`WORKER_ENV`).
    """
    pool = _session_pool()
    with _lock:
        proc = pool.spawn(
            [sys.executable, "-m", module, *args],
            {**os.environ, **WORKER_ENV} if env is None else dict(env),
        )
        pool.fill()  # the next one forked now, off the next start's path
    return proc


class _Process(multiprocessing.context.ForkServerProcess):
    """A forkserver process that runs in the environment its parent had at :meth:`start`."""

    def start(self) -> None:
        self._parent_env = dict(os.environ)  # pickled with the process, as its target is
        super().start()

    def run(self) -> None:
        take_environment(self._parent_env)
        super().run()


class _Context(multiprocessing.context.ForkServerContext):
    Process = _Process


_CONTEXT = _Context()


def mp_context() -> multiprocessing.context.BaseContext:
    """multiprocessing's forkserver, whose server imports torch and torchheal once; each child
    runs in the environment its parent had when it started it (as with spawn)."""
    if COLD:
        return multiprocessing.get_context("spawn")
    _CONTEXT.set_forkserver_preload(list(DEFAULT_PRELOAD))  # read when the server starts
    return _CONTEXT
