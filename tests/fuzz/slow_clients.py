"""Slow clients against every listener: what the server holds for them, and whether it serves.

For each listener a server process (its fuzz target, with the job token set, so every slow
client is a stranger) reads its own RSS; an attacker process opens ``n`` connections: half
send the start of a request that never completes (a partial frame or request head, as large as
the listener's limits let it be), half send nothing. The server reads its RSS while they are
held and makes a normal request; the attacker watches for the server to close each connection,
for at most ``watch_s`` from the start. ``bench/fuzz.py --slow`` prints the table.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchheal._wire.splice import varint

__all__ = ["LISTENERS", "SlowResult", "run_listener", "table"]

TOKEN = "fuzz-token"
#: How long the server samples its RSS with every slow client connected.
HOLD_S = 3.0
# The request heads of the HTTP listeners: 31 header lines of 8,000 bytes (under aiohttp's
# 8 KiB a line and the dashboard's 32 lines; the stdlib servers take 100 lines of 64 KiB).
_HEAD = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(
    b"X-Pad-%02d: " % i + b"a" * 8000 + b"\r\n" for i in range(31)
)
# A gRPC client's preface, empty SETTINGS and the ACK of the server's (a client that does not
# acknowledge them is closed after 60 s anyway), then a HEADERS frame announced at HTTP/2's
# 16 KiB frame limit and cut short: the server holds it while it waits for the rest.
_H2 = (
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    + b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
    + (16384).to_bytes(3, "big")
    + b"\x01\x04\x00\x00\x00\x01"
    + b"\x00" * 16000
)
# A direct-lane hello announced at the 1 MiB first-frame limit, all of it but the last byte
# (the report sent 4 MiB hellos but the last byte: refused at their length now).
_HELLO = varint(1024 * 1024) + b"\x00" * (1024 * 1024 - 1)


class _LaneTarget:
    """The lighthouse's direct lane; its normal request is a quorum that must take the lane."""

    name = "lighthouse direct TCP lane"

    def __init__(self) -> None:
        from torchheal.coordination import LighthouseServer

        self.server = LighthouseServer("127.0.0.1:0", min_replicas=1, join_timeout_ms=1)
        self.port = self.server.direct_port()
        self._step = 0

    def normal(self) -> str | None:
        from datetime import timedelta

        from torchheal.coordination import LighthouseClient

        self._step += 1
        client = LighthouseClient(f"127.0.0.1:{self.server.port()}", timedelta(seconds=10))
        try:
            client.quorum("normal", timedelta(seconds=10), step=self._step, world_size=1)
            return None if client.direct else "served, but over gRPC: the lane refused it"
        except Exception as e:
            return str(e)
        finally:
            client.close()

    def close(self) -> None:
        self.server.shutdown()


def _lighthouse_grpc() -> Any:
    from tests.fuzz.grpc_targets import LighthouseQuorumTarget

    return LighthouseQuorumTarget()


def _manager_grpc() -> Any:
    from tests.fuzz.grpc_targets import ManagerQuorumTarget

    return ManagerQuorumTarget()


def _http(name: str) -> Callable[[], Any]:
    def build() -> Any:
        from tests.fuzz.http_targets import all_targets

        return all_targets()[name]()

    return build


#: Each listener: how to build its target (with ``port`` and ``normal()``), its partial request.
LISTENERS: dict[str, tuple[Callable[[], Any], bytes]] = {
    "lighthouse gRPC": (_lighthouse_grpc, _H2),
    _LaneTarget.name: (_LaneTarget, _HELLO),
    "manager server gRPC": (_manager_grpc, _H2),
    "checkpoint HTTP server": (_http("checkpoint HTTP server"), _HEAD),
    "lighthouse dashboard": (_http("lighthouse dashboard"), _HEAD),
    "parameter server": (_http("parameter server"), _HEAD),
}


@dataclass
class SlowResult:
    """One listener's run (see the module docstring)."""

    name: str
    clients: int
    partial_bytes: int
    rss_before: int = 0
    rss_held: int = 0
    rss_after: int = 0
    normal: str | None = "not run"
    # partial, idle: connections the server closed within 1 s, within the watch, never.
    closed: dict[str, tuple[int, int, int]] | None = None
    watch_s: float = 0.0


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _attack(port: int, partial: bytes, n: int, watch_s: float, pipe: Any) -> None:
    """The attacker process: ``n`` connections, half partial, half idle; reports when closed.

    A thread watches every connection from its start, so one refused at once is seen so.
    """
    socks: list[tuple[str, socket.socket, float]] = []
    ended: dict[int, float] = {}
    connecting = True
    deadline = time.monotonic() + watch_s

    def watch() -> None:
        while time.monotonic() < deadline and (connecting or len(ended) < len(socks)):
            index = {sock.fileno(): i for i, (_, sock, _) in enumerate(socks) if i not in ended}
            if not index:
                time.sleep(0.05)  # none to watch yet
                continue
            readable, _, _ = select.select(list(index), [], [], 0.1)
            for fd in readable:
                i = index[fd]
                try:
                    while socks[i][1].recv(65536):
                        pass  # what the server said before it closed (a refusal)
                    ended[i] = time.monotonic()
                except BlockingIOError:
                    pass  # data, not the end yet
                except OSError:
                    ended[i] = time.monotonic()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    for i in range(n):
        kind = "partial" if i % 2 == 0 else "idle"
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if kind == "partial":
            try:
                sock.sendall(partial)
            except OSError:
                pass  # refused at once (the watcher sees the socket closed)
        sock.setblocking(False)
        socks.append((kind, sock, time.monotonic()))
    connecting = False
    pipe.send("connected")
    watcher.join(watch_s + 10)
    counts: dict[str, tuple[int, int, int]] = {}
    for kind in ("partial", "idle"):
        mine = [(i, t0) for i, (k, _, t0) in enumerate(socks) if k == kind]
        fast = sum(1 for i, t0 in mine if i in ended and ended[i] - t0 <= 1.0)
        later = sum(1 for i, _ in mine if i in ended) - fast
        counts[kind] = (fast, later, len(mine) - fast - later)
    for _, sock, _ in socks:
        sock.close()
    pipe.send(counts)


def run_listener(name: str, n: int, watch_s: float) -> SlowResult:
    """Run the slow clients against one listener (call in a fresh process: RSS is its own)."""
    os.environ["TORCHHEAL_TOKEN"] = TOKEN  # servers and the normal clients alike
    make, partial = LISTENERS[name]
    target = make()
    result = SlowResult(name, n, len(partial), watch_s=watch_s)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    attacker = ctx.Process(target=_attack, args=(target.port, partial, n, watch_s, theirs))
    try:
        target.normal()  # warm: what a first request allocates is not the clients' doing
        result.rss_before = _rss()
        attacker.start()
        assert ours.poll(120), "the attacker did not connect"
        ours.recv()
        held = _rss()
        until = time.monotonic() + HOLD_S
        while time.monotonic() < until:
            time.sleep(0.1)  # sampling the RSS while the clients hold on
            held = max(held, _rss())
        result.normal = target.normal()
        result.rss_held = max(held, _rss())
        assert ours.poll(watch_s + 60), "the attacker did not report"
        result.closed = ours.recv()
        result.rss_after = _rss()
    finally:
        attacker.join(10)
        if attacker.is_alive():
            attacker.kill()
        target.close()
    return result


def table(results: list[SlowResult]) -> str:
    """The slow-client table: one row per listener."""
    head = (
        "listener",
        "slow clients",
        "partial sent",
        "RSS before",
        "RSS held",
        "held / partial client",
        "normal request meanwhile",
        "partial: closed <1s / later / open",
        "idle: closed <1s / later / open",
    )
    rows = []
    for r in results:
        partial = (r.clients + 1) // 2
        closed = r.closed or {}
        rows.append(
            (
                r.name,
                f"{partial} partial + {r.clients - partial} idle",
                f"{r.partial_bytes // 1024} KiB",
                f"{r.rss_before / 2**20:.0f} MiB",
                f"{r.rss_held / 2**20:.0f} MiB",
                f"{(r.rss_held - r.rss_before) / max(1, partial) / 1024:.0f} KiB",
                "ok" if r.normal is None else f"FAILED: {r.normal}"[:60],
                " / ".join(map(str, closed.get("partial", ("?",) * 3))),
                " / ".join(map(str, closed.get("idle", ("?",) * 3))),
            )
        )
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    line = "| " + " | ".join("-" * w for w in widths) + " |"
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |", line]
    out += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    return "\n".join(out) + f"\n(watched for {max((r.watch_s for r in results), default=0):.0f} s)"
