"""A group lost while the cross-replica process group is being built for its quorum.

The lighthouse's notice can come before the build starts, while it waits in the rendezvous for
the lost group's address, or after the build completed anyway: in each case the group for that
quorum must not be used, and a build must never sit out its timeout (60 s here) for a group the
lighthouse says is gone. Real Gloo groups on a real TCPStore; the lost peer simply never comes.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed.distributed_c10d as c10d
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import ReduceOp

from bench.store_freeze import frozen_host
from tests.process_group.helpers import new_store, on_thread, run_ranks
from torchheal.coordination.types import Notice, NoticeKind
from torchheal.manager.failfast import ConnectedQuorum, MemberLostError
from torchheal.manager.log import ManagerLogger
from torchheal.process_group import ProcessGroupGloo

LONG = timedelta(seconds=60)  # the rendezvous's own timeout: far beyond the test's bounds
BOUND_S = 20.0
SHORT = timedelta(seconds=3)  # a group timeout that must bound a build nobody abandons
#: SHORT plus slack for a loaded machine, well below Gloo's own wait (five times SHORT).
SHORT_BOUND_S = 10.0


def _no_heal(_end: object) -> None:
    """No heal runs here: a notice's ``EndHeal`` has nothing to end."""


class Job:
    """One Manager's view: its process group and the connected quorum that guards it."""

    def __init__(self, timeout: timedelta = LONG) -> None:
        self.pg = ProcessGroupGloo(timeout=timeout)
        self.aborts = 0
        self.connected = ConnectedQuorum(
            lambda: self.pg, ManagerLogger(lambda: 0, "me", 0), self._aborted
        )

    def _aborted(self) -> None:
        self.aborts += 1

    def lost(self, replica_id: str, quorum_id: int, reason: str) -> None:
        """The lighthouse's notice that ``replica_id`` of ``quorum_id`` is gone."""
        self.connected.on_notice(Notice(NoticeKind.LOST, replica_id, quorum_id, reason), _no_heal)

    def dropped(self, quorum_id: int, reason: str) -> None:
        """The lighthouse's notice that this group was dropped from ``quorum_id``."""
        self.connected.on_notice(Notice(NoticeKind.DROPPED, "me", quorum_id, reason), _no_heal)

    def connect(self, quorum_id: int, members: list[str]) -> None:
        """Builds the group of ``quorum_id`` (this rank alone in Gloo) and adopts it."""
        store, addr = new_store()
        with self.connected.building(quorum_id, members, store.port):
            self.pg.configure(f"{addr}/q{quorum_id}", "me", 0, 1)
        self.connected.adopt(quorum_id, members)


def test_notice_before_the_build_fails_it_before_it_starts() -> None:
    _store, addr = new_store()
    job = Job()
    job.lost("peer", 7, "connection ended")
    with pytest.raises(MemberLostError, match="peer of quorum 7 was lost before"):
        with job.connected.building(7, ["me", "peer"], _store.port):
            pytest.fail("the build ran although a member was already lost")
    # The step failed for a lost group, as if its group had been aborted (a salvage may follow).
    assert "peer of quorum 7 was lost before" in (job.connected.wait_aborted(0.0) or "")
    # Another quorum (the next one, without or even with the same group) builds normally.
    with job.connected.building(8, ["me"], _store.port):
        job.pg.configure(f"{addr}/q8", "me", 0, 1)
    job.connected.adopt(8, ["me"])
    assert job.connected.quorum_id == 8
    assert job.connected.wait_aborted(0.0) is None
    assert job.aborts == 0


def build_in_rendezvous(
    job: Job, store: TCPStore, addr: str
) -> tuple[threading.Thread, list[BaseException | None]]:
    """Starts the build of quorum 3 with a peer that never publishes its address, on a thread,
    and returns once the build waits in the rendezvous (our address is published)."""

    def build() -> None:
        with job.connected.building(3, ["me", "peer"], store.port):
            job.pg.configure(f"{addr}/q3", "me", 0, 2)

    keys = store.num_keys()
    builder, outcome = on_thread(build)
    deadline = time.monotonic() + BOUND_S
    while store.num_keys() == keys:
        assert time.monotonic() < deadline, "the build never reached the rendezvous"
        time.sleep(0.01)
    return builder, outcome


def test_notice_during_the_build_abandons_the_rendezvous() -> None:
    store, addr = new_store()
    job = Job()
    builder, outcome = build_in_rendezvous(job, store, addr)  # the peer never publishes
    job.lost("other", 3, "not a member: ignored")
    job.lost("peer", 3, "connection ended")
    builder.join(BOUND_S)
    assert not builder.is_alive(), "the build waited on although its peer was lost"
    assert isinstance(outcome[0], MemberLostError), outcome
    assert "while its process group was being built" in str(outcome[0])
    assert_usable_again(job, addr)  # at the next quorum


def test_a_group_dropped_from_the_quorum_it_builds_abandons_the_build_and_nothing_else() -> None:
    # Woken after a freeze, a group builds a quorum its peers left when the lighthouse dropped
    # it: it hears that it was dropped, and stops waiting for them in the rendezvous.
    store, addr = new_store()
    job = Job()
    job.connect(2, ["me"])  # a group in use, which being dropped from quorum 3 leaves alone
    builder, outcome = build_in_rendezvous(job, store, addr)  # the peer left: never publishes
    job.dropped(2, "heartbeat expired")  # not the quorum being built
    builder.join(0.5)
    assert builder.is_alive(), f"a drop from another quorum ended the build: {outcome}"
    job.dropped(3, "heartbeat expired")
    builder.join(BOUND_S)
    assert not builder.is_alive(), "the build waited for peers that left"
    assert isinstance(outcome[0], MemberLostError), outcome
    assert "me of quorum 3 was lost while its process group was being built" in str(outcome[0])
    assert job.aborts == 0
    # Woken, the notice may also come before the build starts: that build fails at once.
    job.dropped(4, "heartbeat expired")
    with pytest.raises(MemberLostError, match="me of quorum 4 was lost before"):
        with job.connected.building(4, ["me", "peer"], store.port):
            pytest.fail("the build ran although this group was dropped from its quorum")
    job.connect(5, ["me"])  # the next quorum builds as usual
    assert job.connected.quorum_id == 5 and job.aborts == 0


def test_notice_during_the_build_ends_it_when_the_lost_group_hosts_a_frozen_store() -> None:
    # A frozen store host accepts and never answers; c10d's client would retry its connection
    # for the whole 60 s, cut or not: the notice abandons the configure too.
    with frozen_host() as port:
        job = Job()

        def build() -> None:
            with job.connected.building(6, ["host", "me"], port):
                job.pg.configure(f"127.0.0.1:{port}/q6", "me", 1, 2)

        builder, outcome = on_thread(build)
        builder.join(0.5)
        assert builder.is_alive(), f"the build ended before the notice: {outcome}"
        job.lost("host", 6, "heartbeat expired")
        builder.join(BOUND_S)
        assert not builder.is_alive(), "the build waited on the frozen store host"
        assert isinstance(outcome[0], MemberLostError), outcome
        assert "store at 127.0.0.1" in str(outcome[0]) and "was abandoned" in str(outcome[0])


def address_of_a_gone_peer(world_size: int) -> bytes:
    """What the last rank of a Gloo group of ``world_size`` publishes, from a peer now gone.

    It comes from a real build of a scratch group, the peer's device on 127.0.0.2, above our
    127.0.0.1: of each pair of ours with it, ours is the end that listens and waits to be
    connected. The scratch groups are then dropped, so the listening socket it names is closed.
    """
    store, _addr = new_store()
    peer = world_size - 1
    groups: dict[int, c10d.ProcessGroupGloo] = {}

    def build(r: int) -> None:
        options = c10d.ProcessGroupGloo._Options()
        options._timeout = LONG
        host = "127.0.0.2" if r == peer else "127.0.0.1"
        options._devices = [c10d.ProcessGroupGloo.create_device(hostname=host)]
        client = TCPStore("127.0.0.1", store.port, is_master=False)
        groups[r] = c10d.ProcessGroupGloo(c10d.PrefixStore("s", client), r, world_size, options)

    run_ranks(world_size, build)
    (key,) = [k for k in store.list_keys() if k.startswith("s/") and k.endswith(f"/{peer}")]
    groups.clear()
    return store.get(key)


def build_with_gone_peers(
    job: Job, world_size: int
) -> tuple[threading.Thread, list[BaseException | None], str, float]:
    """Starts ``job``'s build of quorum 3 as rank 0 of ``world_size`` on a thread, and gives
    every peer the address of a gone one once ours is published: the rendezvous completes, and
    our pairs wait to be connected. Returns the thread, its outcome, the store's address and
    when the build began (monotonic)."""
    gone = address_of_a_gone_peer(world_size)
    store, addr = new_store()
    members = ["me", *[f"peer{r}" for r in range(1, world_size)]]

    def build() -> None:
        with job.connected.building(3, members, store.port):
            job.pg.configure(f"{addr}/q3", "me", 0, world_size)

    began = time.monotonic()
    builder, outcome = on_thread(build)
    deadline = began + BOUND_S
    while not (ours := [k for k in store.list_keys() if k.endswith("/0")]):
        assert time.monotonic() < deadline, "the build never published its address"
        time.sleep(0.01)
    for r in range(1, world_size):  # the same gone address for each (none ever connects)
        store.set(ours[0][: -len("/0")] + f"/{r}", gone)
    return builder, outcome, addr, began


def assert_usable_again(job: Job, addr: str) -> None:
    """The group is configured again (quorum 4, alone), and works."""
    job.pg.configure(f"{addr}/q4", "me", 0, 1)
    t = torch.ones(2)
    job.pg.allreduce([t], ReduceOp.SUM).wait()
    assert t.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_notice_ends_a_build_whose_pair_waits_for_a_peer_gone_after_the_rendezvous(
    world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The peer published its address and is gone (it gave the build up, or died): the
    # rendezvous completes and our pair with it waits to be connected, for Gloo's connect
    # timeout (five times the group's: 300 s here). No store connection is left to cut.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # our device on 127.0.0.1
    job = Job()
    builder, outcome, addr, _began = build_with_gone_peers(job, world_size)
    builder.join(0.5)
    assert builder.is_alive(), f"the build ended before the notice: {outcome}"
    job.lost(f"peer{world_size - 1}", 3, "gave up the build")
    builder.join(BOUND_S)
    assert not builder.is_alive(), "the build waited on for a peer that will never connect"
    assert isinstance(outcome[0], MemberLostError), outcome
    assert "while its process group was being built" in str(outcome[0])
    assert_usable_again(job, addr)


def test_a_build_whose_pair_waits_for_a_gone_peer_ends_at_its_timeout_unannounced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same wait with no notice (a reference lighthouse sends none): Gloo alone would sit
    # five times the group's timeout (15 s for 3 s); the build gives up at its timeout.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    job = Job(timeout=SHORT)
    builder, outcome, addr, began = build_with_gone_peers(job, 2)
    builder.join(SHORT_BOUND_S)
    took = time.monotonic() - began
    assert not builder.is_alive(), f"the build waited on past {SHORT_BOUND_S}s"
    assert outcome[0] is not None and not isinstance(outcome[0], MemberLostError), outcome
    assert took >= SHORT.total_seconds() * 0.9, f"gave up after {took:.2f}s, before its timeout"
    assert_usable_again(job, addr)


def test_notice_the_build_outran_aborts_the_group_at_adoption() -> None:
    store, addr = new_store()
    job = Job()
    with job.connected.building(5, ["me"], store.port):
        job.pg.configure(f"{addr}/q5", "me", 0, 1)
        job.lost("me", 5, "heartbeat expired")  # too late to cut anything
    job.connected.adopt(5, ["me"])
    assert job.connected.quorum_id == -1, "a group whose quorum lost a member was adopted"
    assert job.aborts == 1
    with pytest.raises(AssertionError, match="aborted"):
        job.pg.allreduce([torch.ones(1)], ReduceOp.SUM)


def test_notice_for_the_connected_quorum_aborts_it() -> None:
    job = Job()
    job.connect(2, ["me"])
    job.lost("me", 1, "an older quorum: ignored")
    assert (job.connected.quorum_id, job.aborts) == (2, 0)
    job.lost("me", 2, "connection ended")
    assert (job.connected.quorum_id, job.aborts) == (-1, 1)


def test_a_failed_step_waits_for_the_notice_that_explains_it() -> None:
    """A collective fails on a dead peer's connection first; the lighthouse's word follows."""
    job = Job()
    job.connect(3, ["me"])
    assert job.connected.wait_aborted(0.0) is None

    notice = threading.Thread(target=job.lost, args=("me", 3, "connection ended"))

    class NoticeDuringTheWait(threading.Event):
        """The lighthouse's notice is sent only once the step has begun to wait for it."""

        def wait(self, timeout: float | None = None) -> bool:
            notice.start()
            return super().wait(timeout)

    job.connected._aborted_event = NoticeDuringTheWait()
    assert "me of quorum 3 is lost (connection ended)" in (
        job.connected.wait_aborted(BOUND_S) or ""
    )
    notice.join(BOUND_S)  # (its log line, after the wait ended, belongs to this test)


@pytest.mark.parametrize(
    ("reason", "level"), [("left: shutdown", logging.INFO), ("connection ended", logging.WARNING)]
)
def test_a_peer_that_said_goodbye_is_no_warning(
    reason: str, level: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Every group logs the others' normal ends when a job finishes: that is no failure.
    job = Job()
    job.connect(2, ["me", "peer"])
    with caplog.at_level(logging.INFO, logger="torchheal.manager"):
        job.lost("peer", 2, reason)
    assert job.aborts == 1  # aborted either way
    (record,) = [r for r in caplog.records if "aborting the cross-replica" in r.getMessage()]
    assert record.levelno == level
