"""The process side of a spare template: import once, then fork warm spares on request.

    python [options] -m torchheal.launcher.spare_template --control-fd N [--preload MOD ...]

Launcher side: :mod:`torchheal.launcher.spare_fork`. It preloads at idle CPU priority and says
``{"ready": ...}`` on the control socket (``SOCK_SEQPACKET``, one JSON object per message); if a
fork would not be a faithful spare it says ``"unforkable"`` and exits. Otherwise it serves:

* ``{"fork": {"session": bool}}`` with three file descriptors (stdin, stdout, stderr): forks a
  spare that waits for its hand-over (:func:`torchheal.launcher.spare_child.serve`); answers
  ``{"pid": P}`` or ``{"error": "..."}``.
* Each child's end as ``{"exit": P, "code": C}`` (``C`` as ``Popen.returncode``), since only the
  template, their parent, can collect it.

When the pool closes its end it forks nothing more and exits after its last child. It never
starts a thread (a fork copies only the calling thread). Only JSON crosses the socket; file
descriptors travel as ``SCM_RIGHTS``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

from torchheal.launcher.spare_child import preload, serve
from torchheal.launcher.spare_priority import Priority

#: Longest request read from the control socket.
MAX_REQUEST_BYTES = 65536


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass  # the pool is gone: nobody is left to tell


class _Template:
    def __init__(self, sock: socket.socket, priority: Priority, hurry_fd: int | None) -> None:
        self.sock = sock
        self.hurry_fd = hurry_fd
        self.priority = priority
        self.children: set[int] = set()
        self.open = True
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # A Python handler, so that SIGCHLD wakes the select below through the wake-up fd.
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self._wake_w)

    def run(self) -> None:
        """Serves until the pool closed its end and every child ended."""
        while self.open or self.children:
            watched = [self._wake_r, self.sock] if self.open else [self._wake_r]
            readable, _, _ = select.select(watched, [], [])
            if self._wake_r in readable:
                while True:
                    try:
                        if not os.read(self._wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
            self._reap()
            if self.sock in readable:
                self._serve_one()

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            _send(self.sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def _serve_one(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_REQUEST_BYTES, 3)
        except OSError:
            data, fds = b"", []
        if not data:
            self.open = False  # the pool closed its end
            for fd in fds:
                os.close(fd)
            return
        try:
            request = json.loads(data)
            fork = request["fork"]
            if not isinstance(fork, dict) or len(fds) != 3:
                raise ValueError("a fork request carries an object and 3 file descriptors")
        except (ValueError, KeyError, TypeError) as e:
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"error": f"bad request: {e}"})
            return
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as e:
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"error": f"fork failed: {e}"})
            return
        if pid == 0:
            self._become_spare(fds, bool(fork.get("session")))  # never returns
        for fd in fds:
            os.close(fd)
        self.children.add(pid)
        _send(self.sock, {"pid": pid})

    def _become_spare(self, fds: list[int], session: bool) -> None:
        """In the child: the template's state dropped, the spare's descriptors taken."""
        if self.hurry_fd is not None:
            os.close(self.hurry_fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        if session:
            os.setsid()
        priority = Priority.inherited(self.priority.idle)
        priority.normal_on_handover()
        serve(priority)
        sys.exit(0)  # (serve exits itself)


def _unforkable() -> str | None:
    """Why a fork of this process would not be the spare a fresh interpreter is, or None.

    A fork copies only the calling thread, so threads a preloaded module started would be
    missing; and CUDA initialized here is unusable in a fork.
    """
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:
        return f"the preload started threads a fork would not have: {threads}"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "the preload initialized CUDA, which a forked process cannot use"
    return None


def main(argv: list[str] | None = None) -> None:
    """Preload, say ready, then fork spares until the pool is gone and every child ended."""
    parser = argparse.ArgumentParser(prog="torchheal.launcher.spare_template")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--hurry-fd", type=int, default=None)
    parser.add_argument("--preload", action="append", default=[])
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    template_pid = os.getpid()
    sock = socket.socket(fileno=args.control_fd)
    priority = Priority()
    priority.idle_while_preloading()
    if args.hurry_fd is not None:
        # A rank that came before we went idle must not leave us idle while it waits.
        readable, _, _ = select.select([args.hurry_fd], [], [], 0)
        if readable:
            priority.normal()
    try:
        missing = preload(args.preload)
        ready = {"ready": True, "missing": missing, "s": round(time.monotonic() - t0, 3)}
        unforkable = _unforkable()
        _send(sock, {**ready, "idle": priority.idle, "unforkable": unforkable})
        if unforkable is None:
            _Template(sock, priority, args.hurry_fd).run()
    except KeyboardInterrupt:
        if os.getpid() != template_pid:
            raise  # a rank forked from here: it dies by SIGINT, as the script would
        sys.exit(130)  # Ctrl-C on the launcher's terminal: leave quietly


if __name__ == "__main__":
    main()
