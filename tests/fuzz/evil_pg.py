"""A hostile checkpoint sender in its own process: rank 0 of a real Gloo group, sending raw bytes.

:func:`serve` runs in a spawned process. For each job it joins a fresh two-rank group (this
process rank 0, the fuzzer's receiver rank 1) under the job's store prefix, sends the job's
messages with their tags (a receiver that has refused the transfer never takes the rest),
and aborts the group when the fuzzer says the receive is over.

Gloo aborts the *receiving* process when a message is longer than the buffer the receiver
posted (``gloo::EnforceNotMet``, in its own thread, so ``std::terminate``): no receiver code
can prevent that, so messages here never exceed what the receiver will post for them. A peer
of the replica groups' process group must be trusted that far; see the report of issue 12.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any


def serve(store_port: int, conn: Connection, timeout_s: float, group_timeout_s: float) -> None:
    """Serve jobs from ``conn`` until it closes (run in a spawned process).

    Args:
        store_port: port of the fuzzer's TCPStore on 127.0.0.1.
        conn: jobs ``(prefix, [(tag, bytes), ...])`` in, ``"sent N"`` / ``"error ..."`` out;
            ``"done"`` in ends the current job.
        timeout_s: how long a send may wait.
        group_timeout_s: the group's timeout (its rendezvous).
    """
    import torchheal.process_group.gloo  # noqa: F401  (before the first job: it imports torch)

    conn.send("ready")
    while True:
        try:
            prefix, messages = conn.recv()
        except EOFError:
            return
        conn.send(_job(store_port, conn, prefix, messages, timeout_s, group_timeout_s))


def _job(
    store_port: int,
    conn: Connection,
    prefix: str,
    messages: list[tuple[int, bytes]],
    timeout_s: float,
    group_timeout_s: float,
) -> str:
    """Send one job's messages; return once the fuzzer said ``done`` and the sends ended."""
    import torch

    from torchheal.process_group.gloo import ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=timedelta(seconds=group_timeout_s))
    sent = 0
    error = ""
    done = threading.Event()

    def wait_all(works: list[Any]) -> None:
        nonlocal sent, error
        try:
            for work in works:
                if work is not None:
                    work.wait(timedelta(seconds=timeout_s))
                sent += 1
        except Exception as e:  # the receiver refused and stopped listening
            error = str(e)[:200]
        done.set()

    try:
        pg.configure(f"127.0.0.1:{store_port}/{prefix}", "evil", 0, 2)
        works = [
            pg.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], 1, tag)
            if data
            else None
            for tag, data in messages
        ]
        threading.Thread(target=wait_all, args=(works,), daemon=True).start()
        conn.recv()  # "done": the receiver is finished with this transfer
        if not done.is_set():
            pg.abort()
            done.wait(timeout_s)
    except Exception as e:
        error = str(e)[:200]
        if conn.poll(timeout_s):
            conn.recv()
    finally:
        try:
            pg.shutdown()
        except Exception:
            pass
    return f"sent {sent}" if not error else f"error after {sent}: {error}"
