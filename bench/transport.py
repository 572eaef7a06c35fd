"""Checkpoint transport throughput: HTTP (single stream and chunked) and PG (gloo) on loopback.

Prints one table: for each state size, the GB/s of a raw loopback TCP copy of the same bytes
(``raw socket``: a spawned process sends them from memory, this one receives them into a
reused, already touched buffer: the wire's ceiling on this machine, measured in the same run),
of the machine's memory (a tensor copy into a
reused destination and into a freshly allocated one, which is what a healer receives into;
CRC-32 on one core), of the sender's staging (description + checksums; a CPU state is not
copied) and of a receive, for HTTPTransport num_chunks 0 and 4 (sender already staged and
serving: wire time; into fresh buffers, and "into own": into the receiver's own tensors, as a
restarted group heals) and PGTransport over gloo (end to end: the sender stages inside
``send_checkpoint``, so this includes its staging).

By default (``--mode cross``) the sender runs in a spawned process, as in real healing where
sender and receiver are different replica groups; for PG the spawned sender and this process
form a real two-rank gloo group on a TCPStore bound to port 0. ``--mode same`` runs sender and
receiver as threads of this process, as the tests do.

    .venv/bin/python bench/transport.py [--mode cross|same] [--sizes-mb 100 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import threading
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchheal.checkpointing import HTTPTransport
from torchheal.checkpointing.pg_transport import PGTransport
from torchheal.checkpointing.serialization import byte_view, stage

TIMEOUT = timedelta(seconds=300)


def make_state(total_mb: int) -> dict[str, torch.Tensor]:
    """A state dict of 25 MB float32 tensors (like a model's parameters) totalling total_mb."""
    per = 25 * (1 << 20) // 4
    n = max(1, total_mb // 25)
    return {f"layer{i}.weight": torch.randn(per) for i in range(n)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    """Wall seconds of each of ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def rate(gb: float, times: list[float]) -> tuple[float, float]:
    """(best, median) GB/s."""
    return gb / min(times), gb / statistics.median(times)


def gloo_group(port: int, rank: int) -> Any:
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    return dist.ProcessGroupGloo(dist.PrefixStore("bench", client), rank, 2, TIMEOUT)


# ---------------------------------------------------------------- sender (spawned process)


def _sender(kind: str, mb: int, chunks: int, port: int, repeat: int, conn: Any) -> None:
    """The healthy replica: stages and serves (HTTP) or sends on request (PG)."""
    state = make_state(mb)
    stage({"warm": torch.zeros(1)}, 0)  # first call imports torch.distributed.tensor
    stage_times = timed(lambda: stage(state, 1), repeat)
    if kind == "http":
        src: HTTPTransport = HTTPTransport(TIMEOUT, chunks, hostname="localhost")
        src.send_checkpoint([1], 1, state, TIMEOUT)
        conn.send((stage_times, src.metadata()))
        conn.recv()  # "stop"
        src.shutdown()
        return
    tx: PGTransport = PGTransport(gloo_group(port, 0), TIMEOUT, "cpu")
    conn.send((stage_times, None))
    while conn.recv() == "go":
        tx.send_checkpoint([1], 1, state, TIMEOUT)
    conn.send("done")


def _raw_sender(nbytes: int, port: int, repeat: int) -> None:
    """Sends ``nbytes`` from one buffer ``repeat + 1`` times over one connection."""
    buf = torch.randn(nbytes // 4).view(torch.uint8)
    view = byte_view(buf)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(repeat + 1):
            conn.recv(1)  # "go"
            conn.sendall(view)


def raw_socket(nbytes: int, repeat: int) -> list[float]:
    """Seconds to receive ``nbytes`` over loopback TCP into a reused buffer, per round."""
    server = socket.create_server(("127.0.0.1", 0))
    proc = mp.get_context("spawn").Process(
        target=_raw_sender, args=(nbytes, server.getsockname()[1], repeat), daemon=True
    )
    proc.start()
    conn, _ = server.accept()
    buf = torch.zeros(nbytes, dtype=torch.uint8)  # touched: no page faults while timing
    view = byte_view(buf)

    def once() -> None:
        conn.sendall(b"g")
        pos = 0
        while pos < nbytes:
            n = conn.recv_into(view[pos:])
            if not n:
                raise RuntimeError("raw sender closed early")
            pos += n

    once()  # warm the connection
    times = timed(once, repeat)
    conn.close()
    server.close()
    proc.join(60)
    return times


def _spawn(kind: str, mb: int, chunks: int, port: int, repeat: int) -> tuple[Any, Any]:
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=_sender, args=(kind, mb, chunks, port, repeat, child), daemon=True
    )
    proc.start()
    return proc, parent


def _receive_into(rcv: HTTPTransport, url: str, mb: int, repeat: int) -> list[float]:
    """Seconds per receive into the receiver's own tensors (already touched), as a restarted
    group heals (``into=``: no fresh pages, nothing to copy when loading)."""
    own = make_state(mb)
    return timed(lambda: rcv.recv_checkpoint(0, url, 1, TIMEOUT, into=own), repeat)


def measure_cross(mb: int, repeat: int, only: set[str]) -> dict[str, Any]:
    """Receive rates with the sender in another process."""
    gb = max(1, mb // 25) * (25 << 20) / 1e9  # as make_state
    row: dict[str, Any] = {}
    for chunks in (0, 4):
        if f"http{chunks}" not in only:
            continue
        proc, conn = _spawn("http", mb, chunks, 0, repeat)
        stage_times, url = conn.recv()
        row["stage"] = rate(gb, stage_times)
        rcv: HTTPTransport = HTTPTransport(TIMEOUT, chunks, hostname="localhost")
        rcv.recv_checkpoint(0, url, 1, TIMEOUT)  # warm the connection path
        row[f"http{chunks}"] = rate(
            gb, timed(lambda rcv=rcv, url=url: rcv.recv_checkpoint(0, url, 1, TIMEOUT), repeat)
        )
        row[f"http{chunks}in"] = rate(gb, _receive_into(rcv, url, mb, repeat))
        rcv.shutdown()
        conn.send("stop")
        proc.join(60)
    if "pg" not in only:
        return row
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    proc, conn = _spawn("pg", mb, 0, store.port, repeat)
    rx: PGTransport = PGTransport(gloo_group(store.port, 1), TIMEOUT, "cpu")
    stage_times, _ = conn.recv()
    row.setdefault("stage", rate(gb, stage_times))

    def pg_round() -> None:
        conn.send("go")
        rx.recv_checkpoint(0, "<n/a>", 1, TIMEOUT)

    pg_round()  # warm the pair's connection
    row["pg"] = rate(gb, timed(pg_round, repeat))
    conn.send("stop")
    conn.recv()
    proc.join(60)
    return row


# ---------------------------------------------------------------- same process (threads)


def measure_same(mb: int, repeat: int, only: set[str]) -> dict[str, Any]:
    """Receive rates with sender and receiver as threads of this process."""
    state = make_state(mb)
    gb = nbytes(state) / 1e9
    row: dict[str, Any] = {"stage": rate(gb, timed(lambda: stage(state, 1), repeat))}
    for chunks in (0, 4):
        if f"http{chunks}" not in only:
            continue
        src: HTTPTransport = HTTPTransport(TIMEOUT, chunks, hostname="localhost")
        rcv: HTTPTransport = HTTPTransport(TIMEOUT, chunks, hostname="localhost")
        src.send_checkpoint([1], 1, state, TIMEOUT)
        url = src.metadata()
        row[f"http{chunks}"] = rate(
            gb, timed(lambda rcv=rcv, url=url: rcv.recv_checkpoint(0, url, 1, TIMEOUT), repeat)
        )
        row[f"http{chunks}in"] = rate(gb, _receive_into(rcv, url, mb, repeat))
        src.shutdown()
        rcv.shutdown()
    if "pg" not in only:
        return row
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    pgs: list[Any] = [None, None]

    def make(rank: int) -> None:
        pgs[rank] = gloo_group(store.port, rank)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tx: PGTransport = PGTransport(pgs[0], TIMEOUT, "cpu")
    rx: PGTransport = PGTransport(pgs[1], TIMEOUT, "cpu")

    def pg_round() -> None:
        sender = threading.Thread(target=tx.send_checkpoint, args=([1], 1, state, TIMEOUT))
        sender.start()
        rx.recv_checkpoint(0, "<n/a>", 1, TIMEOUT)
        sender.join()

    row["pg"] = rate(gb, timed(pg_round, repeat))
    return row


def _copy_reused(tensors: list[torch.Tensor], repeat: int) -> list[float]:
    dst = [torch.empty_like(t) for t in tensors]
    for d in dst:
        d.zero_()  # first touch outside the timing
    return timed(lambda: [d.copy_(s) for d, s in zip(dst, tensors, strict=True)], repeat)


def _copy_fresh(tensors: list[torch.Tensor], repeat: int) -> list[float]:
    """Copies into one new allocation per round: big enough to be fresh pages every time."""

    def once() -> None:
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
        pos = 0
        for t in tensors:
            flat[pos : pos + t.numel()].copy_(t)
            pos += t.numel()

    return timed(once, repeat)


def memory_rates(mb: int, repeat: int) -> dict[str, Any]:
    """The machine's reference rates: copies (reused and fresh destination) and CRC-32."""
    state = make_state(mb)
    tensors = list(state.values())
    gb = nbytes(state) / 1e9
    row: dict[str, Any] = {"size": f"{gb * 1e3:.0f} MB"}
    row["raw"] = rate(gb, raw_socket(nbytes(state), repeat))
    row["copy"] = rate(gb, _copy_reused(tensors, repeat))
    row["fresh"] = rate(gb, _copy_fresh(tensors, repeat))
    crc = [byte_view(t.view(torch.uint8)) for t in tensors]
    row["crc32"] = rate(gb, timed(lambda: [zlib.crc32(v) for v in crc], repeat))
    return row


COLUMNS = [
    ("raw", "raw socket"),
    ("copy", "copy reused dst"),
    ("fresh", "copy fresh dst"),
    ("crc32", "crc32 1 core"),
    ("stage", "sender stage"),
    ("http0", "HTTP chunks=0"),
    ("http0in", "HTTP 0 into own"),
    ("http4", "HTTP chunks=4"),
    ("http4in", "HTTP 4 into own"),
    ("pg", "PG gloo e2e"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=["cross", "same"], default="cross")
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--only", nargs="+", choices=["http0", "http4", "pg"], default=["http0", "http4", "pg"]
    )
    args = parser.parse_args()
    stage({"warm": torch.zeros(1)}, 0)  # first call imports torch.distributed.tensor
    measure = measure_cross if args.mode == "cross" else measure_same
    rows = []
    for mb in args.sizes_mb:
        row = memory_rates(mb, args.repeat)
        row.update(measure(mb, args.repeat, set(args.only)))
        rows.append(row)
        print(f"done {row['size']}", flush=True)
    where = "sender in a spawned process" if args.mode == "cross" else "one process, threads"
    print(
        f"\nthroughput in GB/s (1 GB = 1e9 bytes), best / median of {args.repeat}; loopback, {where}"
    )
    print(" | ".join(f"{h:>15}" for h in ["state", *(h for _, h in COLUMNS)]))
    for row in rows:
        cells = [f"{row['size']:>15}"]
        cells += [
            f"{row[c][0]:>7.2f} /{row[c][1]:>5.2f}" if c in row else f"{'-':>15}"
            for c, _ in COLUMNS
        ]
        print(" | ".join(cells))
    print("\nreceive rate / raw socket rate (best / median; goal >= 0.80)")
    shown = [
        c for c in ("http0", "http0in", "http4", "http4in", "pg") if any(c in row for row in rows)
    ]
    print(" | ".join(f"{h:>15}" for h in ["state", *shown]))
    for row in rows:
        cells = [f"{row['size']:>15}"]
        for c in shown:
            if c in row:
                best, median = (row[c][i] / row["raw"][i] for i in (0, 1))
                cells.append(f"{best:>7.2f} /{median:>5.2f}")
            else:
                cells.append(f"{'-':>15}")
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
