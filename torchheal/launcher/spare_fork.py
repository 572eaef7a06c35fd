"""The launcher's side of a spare template (:mod:`torchheal.launcher.spare_template`).

:class:`SpareTemplate` starts the template, asks it for forks and collects its children's exit
statuses (only their parent can). :class:`ForkedSpare` is a :class:`subprocess.Popen` whose
``poll``/``wait`` read those statuses, so the launcher treats it as any process it started.
Linux only: :func:`supported`.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import select
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = ["ForkedSpare", "SpareTemplate", "supported"]

logger = logging.getLogger(__name__)

_TEMPLATE = "torchheal.launcher.spare_template"
#: How long a fork request may take (the template forks at once once it is ready).
FORK_TIMEOUT_S = 30.0
#: Exit status reported for a forked process whose template died first (its status is lost).
LOST_STATUS = 255


def supported() -> bool:
    """Whether this platform can run a spare template."""
    return hasattr(socket, "SOCK_SEQPACKET") and hasattr(socket, "send_fds") and hasattr(os, "fork")


class SpareTemplate:
    """One template process: started at once, ready once its ``preload`` imports are done."""

    def __init__(
        self,
        interpreter: Sequence[str],
        preload: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | None,
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Written by hurry(), so a hurry() that comes before the template went idle is not lost.
        hurry_r, self._hurry_w = os.pipe()
        argv = [*interpreter, "-m", _TEMPLATE, "--control-fd", str(theirs.fileno())]
        argv += ["--hurry-fd", str(hurry_r)]
        for module in preload:
            argv += ["--preload", module]
        try:
            self.proc = subprocess.Popen(
                argv,
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(), hurry_r),
                text=True,
                errors="replace",
            )
        except BaseException:
            ours.close()
            os.close(self._hurry_w)
            raise
        finally:
            theirs.close()
            os.close(hurry_r)
        self._sock = ours
        self._fork_lock = threading.Lock()  # one fork request in flight at a time
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        self._closed = False  # the template's end is gone
        self.ready: dict[str, Any] | None = None
        self.output: list[str] = []  # what it printed (the last 50 lines)
        threading.Thread(target=self._read, name="spare-template", daemon=True).start()
        threading.Thread(target=self._drain, name="spare-template-out", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """It runs and still answers."""
        return not self._closed and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> bool:
        """Until it said it is ready (True: :attr:`ready` holds what it said), it died first,
        or ``timeout`` ran out (False)."""
        with self._changed:
            self._changed.wait_for(lambda: self.ready is not None or self._closed, timeout)
            return self.ready is not None

    def hurry(self) -> None:
        """Puts every thread of the template back at normal CPU priority: a rank waits for its
        imports, which could starve at idle priority."""
        if self._hurry_w >= 0:  # first: see the template's side
            with contextlib.suppress(OSError):
                os.write(self._hurry_w, b"!")
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{self.pid}/task")]
        except OSError:
            return
        for tid in tids:
            with contextlib.suppress(OSError):  # gone, or not ours to raise
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))

    def fork(self, stdin: int, stdout: int, stderr: int, *, session: bool) -> int:
        """A new spare with these descriptors as its 0, 1 and 2; returns its pid.

        Raises:
            OSError: the template is gone, not ready, or could not fork.
        """
        if self.ready is None:
            raise OSError("the spare template has not finished its imports")
        with self._fork_lock:
            request = json.dumps({"fork": {"session": session}}).encode()
            socket.send_fds(self._sock, [request], [stdin, stdout, stderr])
            try:
                reply = self._replies.get(timeout=FORK_TIMEOUT_S)
            except queue.Empty:
                raise OSError(
                    f"the spare template did not fork within {FORK_TIMEOUT_S} s"
                ) from None
        if reply is None:
            raise OSError("the spare template is gone")
        if "pid" not in reply:
            raise OSError(f"the spare template could not fork: {reply.get('error')}")
        return int(reply["pid"])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The exit status of forked process ``pid``, waiting up to ``timeout`` (None: no end).

        None when it still runs after ``timeout``. When the template died first, the status is
        lost: :data:`LOST_STATUS` once the process is gone.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._closed, timeout)
            if pid in self._exits:
                return self._exits[pid]
        if not self._closed:
            return None
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if _wait_gone(pid, left):
            logger.warning("warm spare %d ended after its template: its exit status is lost", pid)
            return LOST_STATUS
        return None

    def close(self) -> None:
        """Forks nothing more. The template exits once its last child (a running rank) ends."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        if self._hurry_w >= 0:
            os.close(self._hurry_w)
            self._hurry_w = -1

    def kill(self) -> None:
        """Ends the template itself (its children, running ranks included, are not touched)."""
        self.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            try:
                message = json.loads(data)
            except ValueError:
                logger.warning("spare template sent garbage: %r", data[:200])
                continue
            if "exit" in message:
                with self._changed:
                    self._exits[int(message["exit"])] = int(message["code"])
                    self._changed.notify_all()
            elif "ready" in message:
                with self._changed:
                    self.ready = message
                    self._changed.notify_all()
            else:
                self._replies.put(message)
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._replies.put(None)
        self._sock.close()
        self.proc.wait()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output = [*self.output[-49:], line.rstrip("\n")]
            logger.info("spare template: %s", line.rstrip("\n"))


def _wait_gone(pid: int, timeout: float | None) -> bool:
    """Until ``pid`` no longer exists (it is not our child), bounded by ``timeout``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


class ForkedSpare(subprocess.Popen):  # type: ignore[type-arg]
    """A spare forked by a :class:`SpareTemplate`: a :class:`subprocess.Popen` whose exit
    status comes from the template (its parent) instead of ``waitpid``.

    Made with :meth:`start`, never by calling the class.
    """

    _template: SpareTemplate

    @classmethod
    def start(
        cls,
        template: SpareTemplate,
        args: Sequence[str],
        *,
        stdout: int | IO[Any] | None,
        stderr: int | IO[Any] | None,
        session: bool,
    ) -> ForkedSpare:
        """Forks a spare whose stdin is a pipe to us and whose output goes where ``stdout`` and
        ``stderr`` say (as :class:`subprocess.Popen`'s arguments)."""
        ours: list[int] = []  # our ends of pipes
        theirs: list[int] = []  # what the template receives (closed here once sent)
        try:
            stdin_r, stdin_w = os.pipe()
            ours.append(stdin_w)
            theirs.append(stdin_r)
            out_r = _child_end(stdout, 1, ours, theirs)
            if stderr == subprocess.STDOUT:
                theirs.append(os.dup(theirs[-1]))
                err_r = None
            else:
                err_r = _child_end(stderr, 2, ours, theirs)
            pid = template.fork(*theirs, session=session)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        self = cls.__new__(cls)
        self._template = template
        self.args = list(args)
        self.pid = pid
        self.returncode = None
        self.encoding = None
        self.errors = "replace"
        self.pipesize = -1
        self.text_mode = True
        self.universal_newlines = True
        self._sigint_wait_secs = 0.25
        self._closed_child_pipe_fds = True
        self._communication_started = False
        self._input = None
        self._child_created = False  # (Popen.__del__: nothing of ours to reap)
        self._waitpid_lock = threading.Lock()
        self.stdin = _text(stdin_w, "w")
        self.stdout = None if out_r is None else _text(out_r, "r")
        self.stderr = None if err_r is None else _text(err_r, "r")
        return self

    def _internal_poll(self, _deadstate: int | None = None, **_: Any) -> int | None:
        if self.returncode is None:
            self.returncode = self._template.exit_code(self.pid, 0.0)
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self.returncode is None:
            self.returncode = self._template.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode


def _child_end(
    target: int | IO[Any] | None, default_fd: int, ours: list[int], theirs: list[int]
) -> int | None:
    """Appends the child's descriptor for ``target`` to ``theirs``; returns our read end when
    ``target`` is ``PIPE`` (and records it in ``ours``), else None."""
    if target == subprocess.PIPE:
        r, w = os.pipe()
        ours.append(r)
        theirs.append(w)
        return r
    if target is None:
        theirs.append(os.dup(default_fd))
    elif target == subprocess.DEVNULL:
        theirs.append(os.open(os.devnull, os.O_WRONLY))
    elif isinstance(target, int):
        theirs.append(os.dup(target))
    else:
        theirs.append(os.dup(target.fileno()))
    return None


def _text(fd: int, mode: str) -> IO[str]:
    """A text stream on ``fd`` as :class:`subprocess.Popen` makes with ``text=True, bufsize=1,
    errors="replace"``."""
    if mode == "w":
        return io.TextIOWrapper(
            open(fd, "wb"), line_buffering=True, write_through=True, errors="replace"
        )
    return io.TextIOWrapper(open(fd, "rb"), errors="replace")
