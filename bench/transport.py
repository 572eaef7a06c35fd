"""Checkpoint transport throughput: HTTP (single stream and chunked) and PG (gloo) on loopback.

Prints one table: for each state size, the GB/s of a plain tensor copy (memory bandwidth),
CRC-32 (one core) and staging (description + parallel checksums), and the end-to-end GB/s of
a receive (sender already staged) for HTTPTransport num_chunks 0 and 4 and PGTransport over
gloo. Sender and receiver run in this one process (threads), as in the tests.

    .venv/bin/python bench/transport.py [--sizes-mb 100 1000] [--repeat 2]
"""

from __future__ import annotations

import argparse
import threading
import time
import zlib
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from torchheal.checkpointing import HTTPTransport
from torchheal.checkpointing.pg_transport import PGTransport
from torchheal.checkpointing.serialization import byte_view, stage

TIMEOUT = timedelta(seconds=120)


def make_state(total_mb: int) -> dict[str, torch.Tensor]:
    """A state dict of 25 MB float32 tensors (like a model's parameters) totalling total_mb."""
    per = 25 * (1 << 20) // 4
    n = max(1, total_mb // 25)
    return {f"layer{i}.weight": torch.randn(per) for i in range(n)}


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gloo_pair() -> list[object]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    groups: list[object] = [None, None]

    def make(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=TIMEOUT)
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("bench", client), rank, 2, TIMEOUT)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [*groups, store]


def measure(mb: int, pgs: list[object], repeat: int) -> dict[str, object]:
    """One table row: throughputs for a state of ``mb`` megabytes."""
    state = make_state(mb)
    tensors = list(state.values())
    gb = sum(t.numel() * t.element_size() for t in tensors) / 1e9
    row: dict[str, object] = {"size": f"{gb * 1e3:.0f} MB"}
    dst = [torch.empty_like(t) for t in tensors]
    row["copy"] = gb / best(lambda: [d.copy_(s) for d, s in zip(dst, tensors, strict=True)], repeat)
    crc = [byte_view(t.view(torch.uint8)) for t in tensors]
    row["crc32"] = gb / best(lambda: [zlib.crc32(v) for v in crc], repeat)
    row["stage"] = gb / best(lambda: stage(state, 1), repeat)
    for chunks in (0, 4):
        src = HTTPTransport(TIMEOUT, chunks, hostname="localhost")
        rcv = HTTPTransport(TIMEOUT, chunks, hostname="localhost")
        src.send_checkpoint([1], 1, state, TIMEOUT)
        row[f"http{chunks}"] = gb / best(
            lambda rcv=rcv, src=src: rcv.recv_checkpoint(0, src.metadata(), 1, TIMEOUT), repeat
        )
        src.shutdown()
        rcv.shutdown()
    tx = PGTransport(pgs[0], TIMEOUT, "cpu")
    rx = PGTransport(pgs[1], TIMEOUT, "cpu")

    def pg_round() -> None:
        sender = threading.Thread(target=tx.send_checkpoint, args=([1], 1, state, TIMEOUT))
        sender.start()
        rx.recv_checkpoint(0, "<n/a>", 1, TIMEOUT)
        sender.join()

    row["pg"] = gb / best(pg_round, repeat)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    pgs = gloo_pair()
    stage({"warm": torch.zeros(1)}, 0)  # first call imports torch.distributed.tensor
    rows = []
    for mb in args.sizes_mb:
        rows.append(measure(mb, pgs, args.repeat))
        print(f"done {rows[-1]['size']}", flush=True)
    cols = ["size", "copy", "crc32", "stage", "http0", "http4", "pg"]
    heads = [
        "state",
        "tensor copy",
        "crc32 1 core",
        "stage (crc ||)",
        "HTTP chunks=0",
        "HTTP chunks=4",
        "PG gloo",
    ]
    print(f"\nthroughput in GB/s (1 GB = 1e9 bytes), best of {args.repeat}; loopback, one process")
    print(" | ".join(f"{h:>14}" for h in heads))
    for row in rows:
        print(" | ".join(f"{row[c]:>14}" if c == "size" else f"{row[c]:>14.2f}" for c in cols))


if __name__ == "__main__":
    main()
