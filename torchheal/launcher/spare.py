"""Warm spares: processes that have already imported torch, waiting to become a restarted rank.

A restarted group loses seconds to interpreter start and imports; a launcher can pay that
before the failure. :meth:`SparePool.spawn` hands a spare the rank's argv, environment and
working directory (one JSON line on its stdin) and returns the spare's :class:`subprocess.Popen`,
which from then on is the rank; without a usable spare (``spare_command.py``) it starts cold.
On Linux spares are forked from one preloaded template (``spare_fork.py``), so a refill costs
milliseconds, not an ``import torch``. Nothing is pickled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from torchheal._base.launch_env import WARM_SPARE_ENV
from torchheal.launcher.spare_command import (
    PythonCommand,
    parse_python_command,
    resolve_interpreter,
    startup_differences,
)
from torchheal.launcher.spare_fork import SpareTemplate, supported
from torchheal.launcher.spare_process import (
    ForkedSpareProcess,
    SpareProcess,
    close_ready,
    leftover,
    read_ready,
    start_fresh,
)

__all__ = ["DEFAULT_PRELOAD", "WARM_ENV", "SparePool"]

logger = logging.getLogger(__name__)

#: Set to "1" in the environment of a rank that started from a warm spare.
WARM_ENV = WARM_SPARE_ENV
#: What a spare imports by default (``torch._dynamo``: the first optimizer built imports it).
DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torchheal.manager",
    "torchheal.process_group",
    "torchheal.ddp",
    "torchheal.optim",
    "torchheal.checkpointing",
)
#: How long a rank waits for a template still importing before it starts cold instead.
HURRY_TIMEOUT_S = 120.0
#: A pool stops starting spares after this many in a row died before being taken.
MAX_SPARE_FAILURES = 3


class SparePool:
    """Keeps ``size`` warm spares for one Python command, and starts ranks from them.

    Args:
        command: the ranks' command (only its interpreter and options matter).
        size: how many spares to keep (0: :meth:`spawn` always starts cold).
        env: the ranks' base environment, so that only per-rank variables differ.
        cwd: the working directory spares start in, and ranks run in unless told otherwise.
        preload: modules a spare imports before it waits (one that fails is skipped with a
            warning: the script meets the error itself if it needs it).
        stdout: where ranks' output goes (as :class:`subprocess.Popen`'s argument).
        stderr: where ranks' errors go.
        start_new_session: start every rank (and spare) in a session of its own.
        fork: fork spares from one template that imported ``preload`` once (default: where
            the platform can, Linux) instead of starting fresh interpreters.
    """

    def __init__(
        self,
        command: Sequence[str],
        size: int = 1,
        *,
        env: Mapping[str, str],
        cwd: str | None = None,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        stdout: int | IO[Any] | None = subprocess.PIPE,
        stderr: int | IO[Any] | None = subprocess.STDOUT,
        start_new_session: bool = False,
        fork: bool | None = None,
    ) -> None:
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if fork and not supported():
            raise ValueError("forked spares need Linux (SOCK_SEQPACKET Unix sockets, SCM_RIGHTS)")
        self._fork = supported() if fork is None else fork
        self._template: SpareTemplate | None = None
        self._hurried_at: float | None = None  # when a rank first waited for the template
        self.size = size
        self._env = dict(env)
        self._cwd = cwd
        self._preload = list(preload)
        self._popen: dict[str, Any] = dict(
            stdout=stdout,
            stderr=stderr,
            text=True,
            bufsize=1,
            errors="replace",
            start_new_session=start_new_session,
        )
        python = parse_python_command(command)
        # ``python -c CODE`` is never handed over (it would take ``exec``): no spares for it.
        self._python = python if python is not None and python.kind != "code" else None
        if size and self._python is None:
            logger.info("warm spares off: %r is not a Python script or module", list(command)[:3])
        self._spares: list[SpareProcess] = []
        self._failures = 0
        self._warned: set[str] = set()
        #: Ranks started from a spare, and cold.
        self.taken = 0
        self.cold = 0

    @property
    def enabled(self) -> bool:
        """Spares are kept (a Python command, size > 0, and spares have not kept dying)."""
        return bool(self.size) and self._python is not None and self._failures < MAX_SPARE_FAILURES

    def fill(self) -> int:
        """Starts spares until ``size`` are alive; returns how many processes it started.

        With ``fork``, the first call starts the template (counted); later calls fork spares
        once it has finished its imports.
        """
        self._drop_dead()
        if not self._fork:
            started = 0
            while self.enabled and len(self._spares) < self.size:
                self._spares.append(self._start_spare())
                started += 1
            return started
        if not self.enabled or len(self._spares) >= self.size:
            return 0
        if self._template is None:
            self._template = self._start_template()
            self._hurried_at = None
            return 1
        started = 0
        while len(self._spares) < self.size and (spare := self._fork_spare()) is not None:
            self._spares.append(spare)
            started += 1
        return started

    def _check_template(self) -> None:
        """Spares start fresh from now on if the template said a fork of it would not do."""
        template = self._template
        why = (
            None if template is None or template.ready is None else template.ready.get("unforkable")
        )
        if why:
            self._warn(f"warm spares start fresh, not forked: {why}")
            self._fork = False
            self._template = None
            template.kill()

    def _start_template(self) -> SpareTemplate:
        assert self._python is not None
        return SpareTemplate(self._python.interpreter, self._preload, env=self._env, cwd=self._cwd)

    def preparing(self) -> bool:
        """A rank is due and a spare is on its way: the template still imports.

        Hurries the template the first time. A caller with other work polls this and spawns
        once it is False (after ``HURRY_TIMEOUT_S`` :meth:`spawn` starts cold).
        """
        template = self._template
        if not self.enabled or template is None or template.ready is not None:
            return False
        return template.alive() and self._hurry_left(template) > 0

    def _hurry_left(self, template: SpareTemplate) -> float:
        """Seconds a rank may still wait for ``template`` (hurried on the first call)."""
        now = time.monotonic()
        if self._hurried_at is None:
            self._hurried_at = now
            template.hurry()
        return HURRY_TIMEOUT_S - (now - self._hurried_at)

    def _fork_when_ready(self) -> SpareProcess | None:
        """A fork once the hurried template finishes its imports (sooner than a cold start)."""
        template = self._template
        if template is None or template.ready is not None or not template.alive():
            return None
        if not template.wait_ready(max(0.0, self._hurry_left(template))):
            self._drop_dead()
            return None
        self._drop_dead()
        return self._fork_spare()

    def _fork_spare(self) -> SpareProcess | None:
        """A spare forked from the template; None while it imports, or when it is gone."""
        template = self._template
        if template is None or template.ready is None or not template.alive():
            return None
        try:
            spare = ForkedSpareProcess.start(
                template,
                template.proc.args,  # type: ignore[arg-type]
                stdout=self._popen["stdout"],
                stderr=self._popen["stderr"],
                session=self._popen["start_new_session"],
            )
        except OSError as e:
            logger.warning("could not fork a warm spare: %s", e)
            return None
        self._failures = 0
        for missing in template.ready.get("missing", ()):
            self._warn(f"a warm spare could not preload {missing}")
        return spare

    def _start_spare(self) -> SpareProcess:
        assert self._python is not None
        return start_fresh(
            self._python.interpreter, self._preload, self._env, self._cwd, self._popen
        )

    def _check_ready(self, spare: SpareProcess, timeout: float = 0.0) -> bool:
        """Reads the spare's ready line if it is there (waiting up to ``timeout``)."""
        if read_ready(spare, timeout):
            self._failures = 0
            for missing in spare.missing:
                self._warn(f"a warm spare could not preload {missing}")
        return spare.ready

    def wait_ready(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s until every spare (with ``fork``: the template, then
        forks the spares) has finished preloading; False when time ran out, a spare died
        first, or there is none."""
        deadline = time.monotonic() + timeout
        if self._fork:
            if self._template is None or not self._template.wait_ready(timeout):
                return False
            self.fill()
            if self._fork:
                return bool(self._spares)
            # it could not fork: fill() started fresh spares instead, waited for below
        for spare in list(self._spares):
            if self._check_ready(spare, max(0.0, deadline - time.monotonic())):
                continue
            if spare.ready_fd is None:  # it closed its end unready: it is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    spare.wait(max(0.0, deadline - time.monotonic()))
            return False
        return bool(self._spares)

    @property
    def pids(self) -> list[int]:
        """The pids of the spares waiting to be handed a rank."""
        return [s.pid for s in self._spares]

    @property
    def template_pid(self) -> int | None:
        """The pid of the template spares are forked from (None when there is none)."""
        return None if self._template is None else self._template.pid

    @property
    def ready(self) -> int:
        """How many spares have finished preloading."""
        return sum(self._check_ready(s) for s in self._spares if s.poll() is None)

    def _drop_dead(self) -> None:
        self._check_template()
        template = self._template
        if template is not None and not template.alive():
            self._template = None
            self._failures += 1
            output = "\n".join(template.output[-20:])
            logger.warning(
                "the warm spare template exited with %s%s%s",
                template.proc.wait(),
                "" if template.ready else " before it finished its imports",
                f"; its output:\n{output}" if output else "",
            )
        for spare in [s for s in self._spares if s.poll() is not None]:
            self._spares.remove(spare)
            close_ready(spare)
            self._failures += 1
            output = leftover(spare)
            logger.warning(
                "a warm spare exited with %s before it was used%s",
                spare.returncode,
                f"; its output:\n{output}" if output else "",
            )
            if self._failures >= MAX_SPARE_FAILURES:
                self._warn(
                    f"{self._failures} warm spares in a row died before being used: "
                    "restarts start cold from now on"
                )

    def _warn(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            logger.warning(text)

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None
    ) -> subprocess.Popen[str]:
        """Starts a rank from its command, whole environment and working directory (default:
        the pool's): in a spare when one fits (a :class:`SpareProcess`), else cold."""
        workdir = cwd or self._cwd or os.getcwd()
        command = parse_python_command(argv)
        reason = self._unfit(command, env)
        while reason is None:
            spare = self._pop() or self._fork_spare() or self._fork_when_ready()
            if spare is None:
                reason = "no spare is alive"
                break
            assert command is not None
            message = {
                "kind": command.kind,
                "target": command.target,
                "argv": list(command.args),
                "env": {**env, WARM_ENV: "1"},
                "cwd": workdir,
            }
            spare.ready_at_handover = self._check_ready(spare)
            try:
                assert spare.stdin is not None
                spare.stdin.write(json.dumps(message) + "\n")
                spare.stdin.close()
                spare.stdin = None  # as a cold start's (its stdin is /dev/null now)
            except (OSError, ValueError):
                spare.kill()  # it died as we handed over: try the next one
                spare.wait()
                close_ready(spare)
                continue
            close_ready(spare)
            spare.handed_over = time.time()
            self.taken += 1
            return spare
        logger.debug("starting %s cold: %s", list(argv)[:3], reason)
        self.cold += 1
        return self.cold_start(argv, env, workdir)

    def cold_start(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None = None
    ) -> subprocess.Popen[str]:
        """Starts a rank the ordinary way, with the pool's pipes and session setting."""
        return subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd or self._cwd,
            stdin=subprocess.DEVNULL,
            **self._popen,
        )

    def _unfit(self, command: PythonCommand | None, env: Mapping[str, str]) -> str | None:
        """Why no spare can run this rank, or None when one can."""
        if not self.enabled:
            return "warm spares are off"
        assert self._python is not None
        if command is None or command.kind == "code":
            return "not a Python script or module"
        ours = resolve_interpreter(self._python.interpreter, self._env)
        if resolve_interpreter(command.interpreter, env) != ours:
            return "another interpreter or other interpreter options"
        differ = startup_differences(self._env, env)
        if differ:
            self._warn(f"started cold: read at start-up, these differ from the spare's: {differ}")
            return f"start-up variables differ: {differ}"
        return None

    def _pop(self) -> SpareProcess | None:
        """A live spare, those that finished preloading first; the dead are dropped."""
        self._drop_dead()
        if not self._spares:
            return None
        ready = [s for s in self._spares if self._check_ready(s)]
        spare = (ready or self._spares)[0]
        self._spares.remove(spare)
        return spare

    def close(self) -> None:
        """Ends the spares that were not used (ranks already started are not touched)."""
        for spare in self._spares:
            if spare.poll() is None:
                spare.kill()
            spare.wait()
            close_ready(spare)
            for pipe in (spare.stdin, spare.stdout, spare.stderr):
                if pipe is not None:
                    pipe.close()
        self._spares.clear()
        if self._template is not None:
            if self._template.ready is None:
                self._template.kill()  # still importing: it has forked nothing yet
            else:
                self._template.close()  # it exits once the ranks it forked have ended
            self._template = None

    def __enter__(self) -> SparePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
