"""A Gloo group's TCP connections, found so that aborting the group can cut them.

Gloo's ``abort()`` does not interrupt an operation in flight; ``shutdown(SHUT_RDWR)`` on each
pair socket does (and a peer that resumes cannot write into our buffers). Gloo exposes no handle on its sockets: they are the ESTABLISHED sockets that
appeared while the group was built, minus those marked foreign, cut only if no more than
``world_size - 1`` are open. The listening socket is never touched (Gloo would terminate the
process). See ``docs/failures.md`` (Gloo's connections).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import threading
from dataclasses import dataclass

__all__ = [
    "PairSockets",
    "end_pair_connects",
    "mark_foreign",
    "new_listeners",
    "socket_inodes",
    "unmark_foreign",
]

logger: logging.Logger = logging.getLogger(__name__)

# tcpi_state, the first byte of TCP_INFO (the kernel's TCP_ESTABLISHED and TCP_LISTEN).
_ESTABLISHED = 1
_LISTEN = 10
# A Gloo sequence number on the wire: what a connecting peer writes first (a native uint64).
_SEQUENCE = struct.Struct("=Q")
#: Longest wait to connect to one of our own listening sockets (it answers at once).
_HANG_UP_CONNECT_S = 1.0


@dataclass(frozen=True)
class _Tcp:
    state: int
    local_port: int
    remote_port: int
    local_host: str = ""


_foreign_lock = threading.Lock()
_foreign: set[int] = set()  # inodes of connections that are no Gloo group's


def mark_foreign(sock: socket.socket) -> int | None:
    """Marks a connection as no Gloo group's; returns its inode to unmark (None if closed)."""
    try:
        inode = os.fstat(sock.fileno()).st_ino
    except (OSError, ValueError):
        return None
    with _foreign_lock:
        _foreign.add(inode)
    return inode


def unmark_foreign(inode: int | None) -> None:
    """Forgets a mark of :func:`mark_foreign` (call it once the connection is closed)."""
    if inode is None:
        return
    with _foreign_lock:
        _foreign.discard(inode)


def _foreign_inodes() -> frozenset[int]:
    with _foreign_lock:
        return frozenset(_foreign)


def socket_inodes() -> dict[int, int]:
    """This process's sockets: inode -> file descriptor (empty where ``/proc`` is missing)."""
    found: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(name)
    return found


def _tcp_table(sockets: dict[int, int]) -> dict[int, _Tcp]:
    """inode -> TCP state and ports of the TCP sockets among ``sockets`` (inode -> fd).

    Asked through a duplicate of each descriptor (the descriptor stays its owner's).
    """
    table: dict[int, _Tcp] = {}
    for inode, fd in sockets.items():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if sock.type != socket.SOCK_STREAM:
                continue
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
            host, local = sock.getsockname()[:2]
            try:
                remote = sock.getpeername()[1]
            except OSError:
                remote = 0  # not connected (listening)
            table[inode] = _Tcp(state, local, remote, host)
        except OSError:
            continue
        finally:
            sock.close()
    return table


def new_listeners(before: frozenset[int]) -> list[tuple[str, int]]:
    """This process's listening TCP sockets opened since ``before`` (a Gloo group's being
    built: Gloo listens on one socket per group), as ``(host, port)`` to connect to."""
    if not sys.platform.startswith("linux"):
        return []
    foreign = _foreign_inodes()
    sockets = {i: fd for i, fd in socket_inodes().items() if i not in before and i not in foreign}
    wildcard = {"0.0.0.0": "127.0.0.1", "::": "::1"}
    return [
        (wildcard.get(t.local_host, t.local_host), t.local_port)
        for t in _tcp_table(sockets).values()
        if t.state == _LISTEN
    ]


def end_pair_connects(listeners: list[tuple[str, int]], world_size: int) -> None:
    """Ends at once the waits of a Gloo group being built for peers that will not connect.

    With no connection yet nothing can be cut, so this connects to each listener, writes every
    sequence number below ``world_size`` and hangs up: each waiting pair gets a closed connection,
    and the build fails or completes broken, which the caller must refuse.
    """
    for host, port in listeners:
        for sequence in range(max(world_size, 1)):
            _hang_up_on(host, port, sequence)


def _hang_up_on(host: str, port: int, sequence: int) -> None:
    """Connects to ``host:port``, writes a Gloo sequence number and closes the connection."""
    try:
        conn = socket.create_connection((host, port), timeout=_HANG_UP_CONNECT_S)
    except OSError as e:
        logger.debug("could not reach our own Gloo listener %s:%d: %s", host, port, e)
        return
    inode = mark_foreign(conn)  # never one of a group's pair sockets, even for an instant
    try:
        conn.sendall(_SEQUENCE.pack(sequence))
    except OSError:
        pass  # the listener went away: nothing waits on it any more
    finally:
        conn.close()
        unmark_foreign(inode)


class PairSockets:
    """The connections of one Gloo group: :meth:`before` the build, :meth:`after` right after."""

    def __init__(self, inodes: frozenset[int], expected: int | None = None) -> None:
        self._inodes = inodes
        self._expected = len(inodes) if expected is None else expected

    @staticmethod
    def before() -> frozenset[int]:
        """The sockets that exist before the group is built."""
        if not sys.platform.startswith("linux"):
            return frozenset()
        return frozenset(socket_inodes())

    @classmethod
    def after(cls, before: frozenset[int], world_size: int) -> PairSockets | None:
        """The group's pair sockets, or None when they cannot be told apart with certainty."""
        if world_size <= 1 or not sys.platform.startswith("linux"):
            return None
        sockets = socket_inodes()
        table = _tcp_table(sockets)
        foreign = _foreign_inodes()
        new = [inode for inode in sockets if inode not in before and inode not in foreign]
        listeners = {t.local_port for t in table.values() if t.state == _LISTEN}
        new_listeners = {
            table[inode].local_port
            for inode in new
            if inode in table and table[inode].state == _LISTEN
        }
        others = listeners - new_listeners  # ports of our other servers
        pairs = frozenset(
            inode
            for inode in new
            if inode in table
            and table[inode].state == _ESTABLISHED
            and table[inode].local_port not in others
        )
        if len(pairs) < world_size - 1:
            logger.warning(
                "found %d of the Gloo group's %d connections: aborting it will not interrupt an "
                "operation in flight",
                len(pairs),
                world_size - 1,
            )
            return None
        return cls(pairs, world_size - 1)

    @classmethod
    def to_port(cls, before: frozenset[int], port: int) -> PairSockets:
        """This process's connections to ``port`` opened since ``before`` (a store client's)."""
        if not sys.platform.startswith("linux"):
            return cls(frozenset())
        sockets = {i: fd for i, fd in socket_inodes().items() if i not in before}
        table = _tcp_table(sockets)
        return cls(
            frozenset(
                inode
                for inode in sockets
                if inode not in before
                and inode in table
                and table[inode].state == _ESTABLISHED
                and table[inode].remote_port == port
            )
        )

    def __len__(self) -> int:
        return len(self._inodes)

    def cut(self) -> int:
        """Shuts down every pair socket still open (any thread, any number of times); the count.

        When more candidates are open than the group has connections, none is cut.
        """
        # A connection marked foreign after the group was built is not a pair either.
        foreign = _foreign_inodes()
        open_now = {
            i: fd for i, fd in socket_inodes().items() if i in self._inodes and i not in foreign
        }
        if len(open_now) > self._expected:
            logger.warning(
                "%d connections opened while the Gloo group was built are still open, for its %d: "
                "none is cut (an operation in flight ends with its timeout)",
                len(open_now),
                self._expected,
            )
            return 0
        cut = 0
        for fd in open_now.values():
            try:
                dup = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                dup.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                pass  # already shut down by the peer
            finally:
                dup.close()
        return cut
