"""A store connection to a frozen or a down host, torchheal beside the reference (issue 9).

A replica group's process group connects to the rendezvous store of each new quorum, hosted by
one of the groups. When that host is frozen (SIGSTOP, a hung machine), its kernel still accepts
the connection and nothing answers it. c10d's ``TCPStore`` client then waits for the answer to
its first request with no timeout at all, whatever timeout it was given. On torchheal's
lighthouse the notice that the host is gone abandons the connection; on a lighthouse that sends
no notices (the reference's), only the connection's own timeout can end it.

A host that is down (its process died: connections are refused) is the other case. c10d's
client tries it again until its timeout, then after a random pause tries once more for the whole
timeout, and logs an error with a C++ stack at each try.

This calls each implementation's ``create_store_client`` (what its process group's
``configure`` calls first) with the given timeout, on a real TCPStore whose process has
stopped itself and on a port nothing listens on, and reports how it ended (giving up on it
after ``--cap-s``) and how many lines c10d logged meanwhile. ``torchheal-build`` is torchheal's
call as its process groups make it: with an event that could abandon it (never set here), in
attempts of a second.

    python -m bench.store_freeze [--timeout-s 2] [--cap-s 20]
        [--impls torchheal,torchheal-build,torchft]
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection

from bench._cluster import reference_available


def _frozen_host(conn: Connection) -> None:
    """Child process: hosts a TCPStore, sends its port, then stops itself."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    os.kill(os.getpid(), signal.SIGSTOP)


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@contextmanager
def frozen_host() -> Iterator[int]:
    """The port of a TCPStore whose process is stopped (killed on exit)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    host = ctx.Process(target=_frozen_host, args=(child,), daemon=True)
    host.start()
    try:
        port = parent.recv()
        while not is_stopped(host.pid):
            parent.poll(0.01)
        yield port
    finally:
        os.kill(host.pid, signal.SIGKILL)
        host.join(10)


@contextmanager
def down_host() -> Iterator[int]:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield port


@contextmanager
def c10d_lines() -> Iterator[list[int]]:
    """Counts the lines c10d writes to this process's stderr (fd 2) meanwhile, from any of its
    threads: the list it gives holds the count once the block ends."""
    count: list[int] = []
    saved = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            yield count
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            count.append(sum(b"[c10d]" in line for line in log))


def connect_once(impl: str, host: str, timeout_s: float, cap_s: float) -> tuple[str, float, int]:
    """How ``impl``'s ``create_store_client`` ends on a ``"frozen"`` or ``"down"`` host:
    (outcome, seconds, lines c10d logged)."""
    module = importlib.import_module(
        "torchft.process_group" if impl == "torchft" else "torchheal.process_group"
    )
    # A process group's configure passes the event its abandon_configure sets.
    kwargs = {"abandoned": threading.Event()} if impl == "torchheal-build" else {}
    outcome: list[tuple[str, float]] = []
    # The outer count is dropped: a connection still waiting when it is given up (the
    # reference's, on a frozen host) fails once the host is killed, and logs that, after the cap.
    with c10d_lines():
        with (frozen_host if host == "frozen" else down_host)() as port:
            with c10d_lines() as logged:
                began = time.monotonic()

                def run() -> None:
                    try:
                        module.create_store_client(
                            f"127.0.0.1:{port}/q", timedelta(seconds=timeout_s), **kwargs
                        )
                        outcome.append(("connected", time.monotonic() - began))
                    except Exception as e:
                        outcome.append((f"raised {type(e).__name__}", time.monotonic() - began))

                thread = threading.Thread(target=run, daemon=True)
                thread.start()
                thread.join(cap_s)
            given_up = thread.is_alive()
        thread.join(3 * timeout_s + 10)  # ended by the host's kill, within c10d's retries
    what, seconds = outcome[0] if not given_up else ("still connecting (given up)", cap_s)
    return what, seconds, logged[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-s", type=float, default=2.0, help="the connection's timeout")
    parser.add_argument("--cap-s", type=float, default=20.0, help="when to stop waiting")
    parser.add_argument("--impls", default="torchheal,torchheal-build,torchft")
    args = parser.parse_args()
    impls = [i for i in args.impls.split(",") if i != "torchft" or reference_available()]
    print(f"create_store_client(timeout={args.timeout_s:g}s) on a frozen and on a down store host")
    print(f"{'impl':<16} {'host':<7} {'outcome':<28} {'seconds':>8} {'c10d log lines':>15}")
    for host in ("frozen", "down"):
        for impl in impls:
            what, seconds, lines = connect_once(impl, host, args.timeout_s, args.cap_s)
            print(f"{impl:<16} {host:<7} {what:<28} {seconds:>8.2f} {lines:>15}")
    if "torchft" in args.impls.split(",") and "torchft" not in impls:
        print("(the reference, torchft, is not installed: its row is missing)")


if __name__ == "__main__":
    main()
