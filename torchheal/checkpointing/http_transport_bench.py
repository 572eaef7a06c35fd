"""A quick HTTP transport throughput check, at the reference's module path and with its flags.

``python -m torchheal.checkpointing.http_transport_bench --total-size=1000000000`` sends a state
dict of ``--total-size`` bytes, in tensors of ``--chunk-size`` bytes, from one
:class:`HTTPTransport` to another in this process over loopback, and prints the time and rate.
The side-by-side benchmarks with the reference live in the repository's ``bench/``.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta

import torch

from torchheal.checkpointing.http_transport import HTTPTransport

__all__ = ["main"]


def main(argv: list[str]) -> None:
    """Runs one send and receive with the reference's flags and prints how long it took."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-chunks", type=int, default=0, help="parallel connections")
    parser.add_argument("--device", default="cpu", help="where the tensors live")
    parser.add_argument("--chunk-size", type=int, default=3_000_000, help="bytes per tensor")
    parser.add_argument("--total-size", type=int, default=12_000_000_000, help="bytes in all")
    args = parser.parse_args(argv)
    if args.chunk_size <= 0 or args.total_size <= 0:
        parser.error("--chunk-size and --total-size must be positive")

    device = torch.device(args.device)
    count = max(1, args.total_size // args.chunk_size)
    state = {
        f"chunk_{i}": torch.randint(0, 256, (args.chunk_size,), dtype=torch.uint8, device=device)
        for i in range(count)
    }
    timeout = timedelta(seconds=600)
    sender = HTTPTransport(timeout=timeout, num_chunks=args.num_chunks)
    receiver = HTTPTransport(timeout=timeout, num_chunks=args.num_chunks)
    try:
        sender.send_checkpoint(dst_ranks=[1], step=1, state_dict=state, timeout=timeout)
        start = time.perf_counter()
        received = receiver.recv_checkpoint(0, sender.metadata(), step=1, timeout=timeout)
        seconds = time.perf_counter() - start
        sender.disallow_checkpoint()
    finally:
        sender.shutdown()
        receiver.shutdown()
    if len(received) != count:
        raise RuntimeError(f"received {len(received)} tensors, sent {count}")
    nbytes = count * args.chunk_size
    rate = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    print(f"received {nbytes} bytes in {count} tensors in {seconds:.3f} s ({rate:.2f} GB/s)")


if __name__ == "__main__":
    main(sys.argv[1:])
