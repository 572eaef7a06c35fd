"""Finding a Gloo group's pair sockets from outside, with plain sockets standing in for Gloo's."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from torchheal.process_group.gloo_sockets import (
    PairSockets,
    end_pair_connects,
    mark_foreign,
    new_listeners,
    socket_inodes,
    unmark_foreign,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

_CLIENT = (
    "import socket, sys\n"
    "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
    "sys.stdout.write('connected\\n'); sys.stdout.flush()\n"
    "sys.stdin.read()\n"
)


@pytest.fixture
def visitor() -> Iterator[callable]:
    """Connects another process to a port of ours (a healer fetching our checkpoint)."""
    procs: list[subprocess.Popen[str]] = []

    def connect(port: int) -> None:
        p = subprocess.Popen(
            [sys.executable, "-c", _CLIENT, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline() == "connected\n"

    yield connect
    for p in procs:
        p.kill()
        p.wait()


def _inode(sock: socket.socket) -> int:
    return next(i for i, fd in socket_inodes().items() if fd == sock.fileno())


def test_the_pairs_are_the_new_connections_and_not_another_servers(visitor) -> None:
    ours = socket.create_server(("127.0.0.1", 0))  # one of this process's servers
    before = PairSockets.before()
    group = socket.create_server(("127.0.0.1", 0))  # the group's own listener
    out = socket.create_connection(group.getsockname())  # a connection we opened
    accepted, _ = group.accept()  # and one we accepted on the group's listener
    visitor(ours.getsockname()[1])
    guest, _ = ours.accept()  # a peer of another server, arrived meanwhile
    with ours, group, out, accepted, guest:
        pairs = PairSockets.after(before, world_size=3)
        assert pairs is not None and pairs._inodes == {_inode(out), _inode(accepted)}
        # Fewer candidates than connections: nothing is kept.
        assert PairSockets.after(before, world_size=4) is None
        # Cutting them makes a blocked receive end at once; the guest is left alone.
        assert pairs.cut() == 2
        out.settimeout(5)
        assert out.recv(1) == b""
        guest.setblocking(False)
        with pytest.raises(BlockingIOError):
            guest.recv(1)


def test_a_store_clients_connection_is_found_by_its_port() -> None:
    store = socket.create_server(("127.0.0.1", 0))
    before = PairSockets.before()
    client = socket.create_connection(store.getsockname())
    accepted, _ = store.accept()
    with store, client, accepted:
        found = PairSockets.to_port(before, store.getsockname()[1])
        assert found._inodes == {_inode(client)}


def test_a_connection_closed_after_the_build_is_not_counted_when_cutting() -> None:
    """Gloo's ends sometimes both connect and close the extra connection a little later: the
    group (one peer here) is built with two candidates and cut once the extra one is gone."""
    peer = socket.create_server(("127.0.0.1", 0))  # the peer's listener (its accepted ends
    before = PairSockets.before()  # are on a listener from before: never candidates)
    pair = socket.create_connection(peer.getsockname())
    extra = socket.create_connection(peer.getsockname())
    ends = [peer.accept()[0], peer.accept()[0]]
    try:
        found = PairSockets.after(before, world_size=2)
        assert found is not None and len(found) == 2
        # Both still open: which one is the group's cannot be told, so none is cut.
        assert found.cut() == 0
        extra.close()
        # The extra one closed: the pair is cut, and a receive on it ends at once.
        assert found.cut() == 1
        pair.settimeout(5)
        assert pair.recv(1) == b""
    finally:
        for s in (peer, pair, extra, *ends):
            s.close()


@pytest.mark.parametrize("marked", ["before the scan", "after the scan"])
def test_a_connection_marked_foreign_is_never_a_pair(marked: str) -> None:
    """A healer's checkpoint fetch, opened while its cross-replica group is built: marked
    foreign, it is not counted, so the group's own connection is cut (unmarked it would be a
    second candidate for one peer, and nothing would be cut). It may be marked after the
    scan (its connect came first): it is left out when cutting too."""
    peer = socket.create_server(("127.0.0.1", 0))
    source = socket.create_server(("127.0.0.1", 0))  # a peer's checkpoint server
    before = PairSockets.before()
    pair = socket.create_connection(peer.getsockname())
    fetch = socket.create_connection(source.getsockname())
    ends = [peer.accept()[0], source.accept()[0]]
    inode = mark_foreign(fetch) if marked == "before the scan" else None
    try:
        found = PairSockets.after(before, world_size=2)
        assert found is not None
        if inode is None:
            assert len(found) == 2
            inode = mark_foreign(fetch)
        assert found.cut() == 1
        pair.settimeout(5)
        assert pair.recv(1) == b""
        fetch.setblocking(False)
        with pytest.raises(BlockingIOError):
            fetch.recv(1)  # still open: the fetch goes on
    finally:
        unmark_foreign(inode)
        for s in (peer, source, pair, fetch, *ends):
            s.close()


def test_only_the_builds_own_listeners_are_reached_with_every_sequence() -> None:
    """``new_listeners`` finds the listening sockets opened since the build began (Gloo's),
    never an older server of ours; ``end_pair_connects`` connects to each, writes every
    sequence number below the group's size, and hangs up."""
    ours = socket.create_server(("127.0.0.1", 0))  # one of this process's servers
    before = PairSockets.before()
    group = socket.create_server(("127.0.0.1", 0))  # the group's own listener
    try:
        listeners = new_listeners(before)
        assert listeners == [("127.0.0.1", group.getsockname()[1])]
        end_pair_connects(listeners, 3)
        group.settimeout(5)
        received = []
        for _ in range(3):
            conn, _addr = group.accept()
            with conn:
                conn.settimeout(5)
                data = b""
                while chunk := conn.recv(16):  # then the end: it hung up
                    data += chunk
                received.append(int.from_bytes(data, sys.byteorder))
        assert received == [0, 1, 2]
        ours.setblocking(False)
        group.setblocking(False)
        for server in (ours, group):
            with pytest.raises(BlockingIOError):
                server.accept()  # nothing more came
    finally:
        ours.close()
        group.close()
