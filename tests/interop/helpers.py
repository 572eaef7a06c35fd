"""Drive torchheal and the reference (torchft) coordination objects through one interface.

Both implementations expose the same class names and signatures (reference §2.4); what differs
and is smoothed over here:

* the reference's ``ManagerClient._quorum`` takes an extra ``reconfigure_handle`` (newer wheel);
* the reference's ``address()`` names the machine's hostname, so lighthouses are always reached
  through an explicit ``127.0.0.1:{port}``;
* the only way to observe from outside how many quorum requests a lighthouse holds is its
  "next quorum" reason string (``[healthy/registered participants healthy]``): torchheal
  returns it from ``status()``, the reference serves it on its HTTP ``/status`` page.

Results are normalised to plain tuples/dicts so runs of different implementations (whose
servers listen on different ports) can be compared with ``==``.
"""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

# The reference logs every request at INFO from Rust; keep test output readable. Must be set
# before the reference's module is first imported.
os.environ.setdefault("RUST_LOG", "warn")

CONNECT = timedelta(seconds=5)
HEARTBEAT = timedelta(milliseconds=100)

_PARTICIPANTS = re.compile(r"\[(\d+)/(\d+) participants healthy\]")


@dataclass(frozen=True)
class Impl:
    """One implementation of the coordination plane.

    Args:
        name: "torchheal" or "reference".
        mod: its coordination module (``torchheal.coordination`` / ``torchft.coordination``).
    """

    name: str
    mod: ModuleType

    @property
    def is_reference(self) -> bool:
        return self.name == "reference"

    def __repr__(self) -> str:
        return self.name


def port_of(server: Any) -> int:
    """The port of a lighthouse or manager server of either implementation."""
    return int(server.address().rsplit(":", 1)[1])


def loopback(server: Any) -> str:
    """``http://127.0.0.1:{port}`` of a server."""
    return f"http://127.0.0.1:{port_of(server)}"


class Cluster:
    """Servers and clients started by one test; everything is shut down by :meth:`close`."""

    def __init__(self) -> None:
        self._servers: list[Any] = []
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="interop")

    def lighthouse(self, impl: Impl, min_replicas: int, **kwargs: Any) -> tuple[Any, str]:
        """Start a lighthouse on loopback, port 0; returns it and its loopback URL."""
        server = impl.mod.LighthouseServer("127.0.0.1:0", min_replicas=min_replicas, **kwargs)
        self._servers.append(server)
        return server, loopback(server)

    def manager(
        self, impl: Impl, replica_id: str, lighthouse_addr: str, store_addr: str, world_size: int
    ) -> Any:
        """Start a manager server on loopback whose ``address()`` is a loopback URL."""
        server = impl.mod.ManagerServer(
            replica_id,
            lighthouse_addr,
            "127.0.0.1",
            "127.0.0.1:0",
            store_addr,
            world_size,
            HEARTBEAT,
            CONNECT,
            0,
        )
        self._servers.append(server)
        return server

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        """Run a blocking call on a worker thread (quorum calls block until the round ends)."""
        return self._pool.submit(fn, *args, **kwargs)

    def close(self) -> None:
        for server in reversed(self._servers):
            server.shutdown()
        self._pool.shutdown(wait=True, cancel_futures=True)


def registered(impl: Impl, server: Any) -> int:
    """How many quorum requests the lighthouse currently holds (its participants map)."""
    if impl.is_reference:
        with urllib.request.urlopen(f"{loopback(server)}/status", timeout=5) as response:
            text = response.read().decode()
    else:
        text = server.status()["reason"]
    match = _PARTICIPANTS.search(text)
    assert match is not None, f"no participant count in {text!r}"
    return int(match.group(2))


def wait_registered(impl: Impl, server: Any, count: int, timeout: float = 10.0) -> None:
    """Wait until the lighthouse holds ``count`` quorum requests.

    Only observable by polling (neither implementation signals it), so this polls.
    """
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: an interruptible pause between polls
    while (n := registered(impl, server)) != count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{impl} lighthouse holds {n} requests, expected {count}")
        pause.wait(0.01)


def manager_quorum(
    impl: Impl,
    client: Any,
    group_rank: int,
    step: int,
    checkpoint_metadata: str,
    shrink_only: bool,
    init_sync: bool,
    commit_failures: int,
    timeout: timedelta,
    replica_id: str = "",
) -> Any:
    """``ManagerClient._quorum`` of either implementation.

    The reference's client also sends a reconfigure handle; it is made from ``replica_id`` and
    ``group_rank`` so that tests can check that lighthouses pass handles through.
    """
    args = (group_rank, step, checkpoint_metadata, shrink_only, init_sync, commit_failures, timeout)
    if impl.is_reference:
        return client._quorum(*args, f"handle-{replica_id}-{group_rank}")
    return client._quorum(*args)


def norm_member(member: Any) -> tuple[Any, ...]:
    """A quorum member of either implementation as a comparable tuple."""
    return (
        member.replica_id,
        member.address,
        member.store_address,
        member.step,
        member.world_size,
        member.shrink_only,
        member.data,
    )


def norm_quorum(quorum: Any) -> tuple[int, tuple[tuple[Any, ...], ...]]:
    """A quorum of either implementation as ``(quorum_id, members)``; ``created`` is checked
    separately (it is a wall-clock time)."""
    return quorum.quorum_id, tuple(norm_member(m) for m in quorum.participants)


# The QuorumResult fields both implementations must agree on (recover_src_manager_address is
# compared after mapping the URL to the replica id that owns it: ports differ between runs).
RESULT_FIELDS = (
    "quorum_id",
    "replica_rank",
    "replica_world_size",
    "recover_src_replica_rank",
    "recover_dst_replica_ranks",
    "max_step",
    "max_replica_rank",
    "max_world_size",
    "heal",
    "store_address",
)


def norm_result(result: Any, owners: dict[str, str]) -> dict[str, Any]:
    """A QuorumResult of either implementation as a dict of the compared fields.

    Args:
        result: the QuorumResult.
        owners: manager URL -> replica id, to name the recovery source independent of ports.
    """
    out = {name: getattr(result, name) for name in RESULT_FIELDS}
    out["recover_dst_replica_ranks"] = list(out["recover_dst_replica_ranks"])
    src = result.recover_src_manager_address
    out["recover_src"] = owners.get(src, src) if src else ""
    return out


def gather(futures: Iterable[Future[Any]], timeout: float = 20.0) -> list[Any]:
    """Results of futures in order, each within ``timeout`` seconds."""
    return [f.result(timeout=timeout) for f in futures]
