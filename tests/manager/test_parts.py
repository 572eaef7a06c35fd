"""The Manager's parts, each alone: no lighthouse, no servers, no process group."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from torchheal._base.security import SecurityEnv
from torchheal.checkpointing import CheckpointError, HTTPTransport
from torchheal.coordination.plan import Participation, WorldSizeMode
from torchheal.coordination.types import QuorumResult
from torchheal.manager.log import ManagerLogger
from torchheal.manager.quorum_worker import QuorumWorker, StepRequest
from torchheal.manager.recovery import Recovery, SourceLostError, metadata_over_grpc
from torchheal.manager.settings import ManagerSettings
from torchheal.manager.state import StateRegistry
from torchheal.manager.step import ExceptionWithTraceback, StepLedger

from .twins import MemoryTransport

S = timedelta(seconds=1)


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Polls ``predicate`` (a state only observable by polling) until it is true."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()  # never set: an interruptible pause between polls
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        pause.wait(0.002)


# --- StepLedger ------------------------------------------------------------------------------


class _Work:
    def __init__(self, ledger: StepLedger, error: Exception | None = None) -> None:
        self._waited = False
        self.waits = 0
        self._ledger = ledger
        self._error = error

    def wait(self) -> bool:
        self.waits += 1
        self._waited = True
        if self._error is not None:
            self._ledger.report(self._error)  # what _ManagedWork.wait does
        return True


def test_ledger_settles_only_unwaited_work_and_stops_at_the_first_error() -> None:
    ledger = StepLedger()
    waited, failing, later = _Work(ledger), _Work(ledger, RuntimeError("boom")), _Work(ledger)
    waited.wait()
    for work in (waited, failing, later):
        ledger.track_work(work)
    ledger.settle()
    assert (waited.waits, failing.waits, later.waits) == (1, 1, 0)
    assert isinstance(ledger.error, ExceptionWithTraceback)
    assert str(ledger.error.original_exception) == "boom"
    ledger.settle()  # emptied: nothing waited twice
    assert failing.waits == 1


def test_ledger_begin_clears_the_error_and_the_lists() -> None:
    ledger = StepLedger()
    ledger.report(ValueError("x"))
    work = _Work(ledger)
    ledger.track_work(work)
    ledger.begin()
    assert ledger.error is None
    ledger.settle()
    assert work.waits == 0


def test_reported_error_keeps_where_it_happened() -> None:
    ledger = StepLedger()
    try:
        raise KeyError("missing")
    except KeyError as e:
        assert ledger.report(e) is True  # the step's first error
    assert ledger.error is not None and "raise KeyError" in ledger.error.stack_trace
    assert ledger.report(RuntimeError("never raised")) is False  # it had failed already
    assert "test_reported_error_keeps_where_it_happened" in ledger.error.stack_trace
    ledger.begin()
    assert ledger.report(ValueError("next step")) is True


# --- StateRegistry ---------------------------------------------------------------------------


def test_registry_reads_copies_and_loads() -> None:
    registry = StateRegistry(lock_timeout=S)
    assert registry.empty
    weight = torch.ones(3)
    loaded: list[Any] = []
    registry.register("model", loaded.append, lambda: {"w": weight})
    with pytest.raises(AssertionError, match="already registered"):
        registry.register("model", loaded.append, lambda: {})
    state = registry.read(lambda: {"step": 4, "batches_committed": 8})
    assert state["torchft"] == {"step": 4, "batches_committed": 8}
    assert state["user"]["model"]["w"] is weight
    copy = registry.copy(state)
    weight.add_(1)
    assert torch.equal(copy["user"]["model"]["w"], torch.ones(3))  # a copy, not a view
    registry.load({"model": {"w": 7}})
    assert loaded == [{"w": 7}]
    with pytest.raises(KeyError):
        registry.load({"other": {}})


def test_blocked_reads_wait_and_time_out() -> None:
    registry = StateRegistry(lock_timeout=timedelta(milliseconds=50))
    registry.register("k", lambda s: None, lambda: {})
    registry.block_reads()
    registry.block_reads()  # idempotent
    assert not registry.reads_allowed
    outcome: list[BaseException] = []

    def reader() -> None:
        try:
            registry.read(dict)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(timeout=10)
    assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError)
    registry.unblock_reads()
    registry.unblock_reads()  # idempotent
    assert registry.reads_allowed
    assert registry.read(dict)["user"] == {"k": {}}


def test_reading_nothing_registered_is_an_error() -> None:
    with pytest.raises(AssertionError, match="not initialized"):
        StateRegistry(lock_timeout=S).read(dict)


# --- Recovery --------------------------------------------------------------------------------


def _quorum(**kw: Any) -> QuorumResult:
    base: dict[str, Any] = dict(
        quorum_id=3,
        replica_rank=1,
        replica_world_size=2,
        max_step=5,
        max_replica_rank=None,
        max_world_size=1,
        store_address="store:1",
    )
    base.update(kw)
    return QuorumResult(**base)


def _recovery(transport: MemoryTransport, fetched: list[tuple[str, int]]) -> Recovery:
    def fetch(address: str, group_rank: int, timeout: timedelta) -> str:
        fetched.append((address, group_rank))
        return "sender"  # the source's transport metadata

    return Recovery(transport, fetch, group_rank=1, timeout=S, log=lambda line: None)


def test_recovery_moves_state_as_data() -> None:
    network: dict[tuple[str, int], bytes] = {}
    fetched: list[tuple[str, int]] = []
    sender = _recovery(MemoryTransport(network, "sender"), fetched)
    receiver_transport = MemoryTransport(network, "receiver")
    receiver = _recovery(receiver_transport, fetched)
    state = {"user": {"default": {"w": torch.arange(3.0)}}, "torchft": {"step": 5}}
    sender.send(_quorum(recover_dst_replica_ranks=[1]), state)
    got = receiver.receive(
        _quorum(heal=True, recover_src_replica_rank=0, recover_src_manager_address="http://s:1")
    )
    assert fetched == [("http://s:1", 1)]
    assert receiver_transport.received == [(0, "sender", 5)]
    assert torch.equal(got["user"]["default"]["w"], torch.arange(3.0))
    assert got["torchft"] == {"step": 5}


def test_recovery_rejects_a_heal_without_source_or_sections() -> None:
    network: dict[tuple[str, int], bytes] = {}
    receiver = _recovery(MemoryTransport(network, "receiver"), [])
    with pytest.raises(RuntimeError, match="names no source"):
        receiver.receive(_quorum(heal=True))
    MemoryTransport(network, "sender").send_checkpoint([1], 5, {"user": {}}, S)
    with pytest.raises(RuntimeError, match="sections"):
        receiver.receive(_quorum(heal=True, recover_src_replica_rank=0))


class _FrozenSource:
    """A checkpoint server whose host froze part way through its answer: the connection stays
    open and nothing more arrives (no FIN)."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._conns: list[socket.socket] = []
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/checkpoint/"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._sock.accept()
                self._conns.append(conn)
                conn.recv(65536)
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 1000000\r\n\r\nTHC")

    def close(self) -> None:
        self._sock.close()
        for conn in self._conns:
            conn.close()


def test_a_receive_from_a_source_the_lighthouse_says_is_lost_ends_at_once() -> None:
    """A heal's source frozen mid-answer: the receive ends when the lighthouse's notice names
    that source (in the heal's quorum or a later one), not at its 60 s timeout; notices about
    another group, or about an earlier quorum, leave it be."""
    timeout = timedelta(seconds=60)
    transport: HTTPTransport[Any] = HTTPTransport(timeout, 0, hostname="127.0.0.1")
    lines: list[str] = []
    recovery = Recovery(transport, lambda *a: "", group_rank=0, timeout=timeout, log=lines.append)
    source = _FrozenSource()
    quorum = _quorum(
        heal=True,
        quorum_id=7,
        recover_src_replica_rank=0,
        replica_ids=["g0:source", "g1:healer", "g2:other"],
    )
    failed: list[BaseException] = []

    def receive() -> None:
        try:
            recovery.receive(quorum, source.url)
        except BaseException as e:
            failed.append(e)

    healer = threading.Thread(target=receive)
    try:
        healer.start()
        wait_until(lambda: transport._receives, "the receive to start")
        recovery.on_member_lost("g2:other", 7, "heartbeat expired")
        recovery.on_member_lost("g0:source", 6, "heartbeat expired")  # an older quorum's
        assert not any(a.aborted for a in transport._receives) and healer.is_alive()
        assert lines == ["healing to step 5 from replica rank 0 ()"]
        recovery.on_member_lost("g0:source", 7, "heartbeat expired")
        healer.join(timeout.total_seconds() / 2)
        assert not healer.is_alive(), "the receive waited for its timeout"
        assert len(failed) == 1 and isinstance(failed[0], CheckpointError), failed
        assert "aborted (its source is gone)" in str(failed[0])
        assert "g0:source" in lines[-1] and "aborting the receive" in lines[-1]
    finally:
        source.close()
        healer.join(timeout.total_seconds())
        transport.shutdown()


class _SilentServer:
    """A source's manager server whose host froze: its kernel accepts, nothing answers."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def close(self) -> None:
        self._sock.close()


def test_a_heal_whose_source_the_lighthouse_says_is_lost_gives_up_its_metadata_request() -> None:
    """The source froze before it answered the heal's metadata request (the real gRPC
    request, with the reference's 60 s connect timeout): the request ends at the notice. A heal
    from a source the lighthouse already said was lost ends at once."""
    timeout = timedelta(seconds=60)
    network: dict[tuple[str, int], bytes] = {}
    grpc_fetch = metadata_over_grpc(timeout, SecurityEnv())
    asked: list[str] = []

    def fetch(address: str, rank: int, timeout: timedelta, cancelled: Any = None) -> str:
        asked.append(address)
        if address == source.address:
            return grpc_fetch(address, rank, timeout, cancelled)
        return "sender"  # the in-memory source of the later heal below

    lines: list[str] = []
    recovery = Recovery(
        MemoryTransport(network, "healer"), fetch, group_rank=0, timeout=timeout, log=lines.append
    )
    source = _SilentServer()
    quorum = _quorum(
        heal=True,
        quorum_id=7,
        recover_src_replica_rank=0,
        recover_src_manager_address=source.address,
        replica_ids=["g0:source", "g1:healer"],
    )
    failed: list[BaseException] = []

    def receive() -> None:
        try:
            recovery.receive(quorum)
        except BaseException as e:
            failed.append(e)

    healer = threading.Thread(target=receive)
    try:
        healer.start()
        healer.join(0.5)
        assert healer.is_alive(), f"the request ended before the notice: {failed}"
        recovery.on_member_lost("g0:source", 7, "heartbeat expired")
        healer.join(timeout.total_seconds() / 4)
        assert not healer.is_alive(), "the metadata request waited for its connect timeout"
        assert len(failed) == 1 and isinstance(failed[0], SourceLostError), failed
        assert "given up: the lighthouse says its group is lost" in str(failed[0])
        # The same source again, in the same quorum: given up before it is asked.
        with pytest.raises(SourceLostError, match="already lost"):
            recovery.receive(quorum)
        assert asked == [source.address]
        # A later quorum may name it again (it was frozen and came back): that heal goes on.
        MemoryTransport(network, "sender").send_checkpoint([1], 5, {"user": {}, "torchft": {}}, S)
        later = _quorum(
            heal=True,
            quorum_id=8,
            recover_src_replica_rank=0,
            recover_src_manager_address="back",
            replica_ids=["g0:source", "g1:healer"],
        )
        assert recovery.receive(later) == {"user": {}, "torchft": {}}
    finally:
        source.close()
        healer.join(timeout.total_seconds())


class _InPlaceMemory(MemoryTransport):
    """Says it receives in place and takes ``into`` (records what it was given)."""

    receives_in_place = True

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: Any, **kw: Any):
        self.into = kw.get("into")
        return super().recv_checkpoint(src_rank, metadata, step, timeout)


class _OldSignature(MemoryTransport):
    """Says it receives in place, but its recv_checkpoint (an override) takes no ``into``."""

    receives_in_place = True


def test_recovery_receives_in_place_only_where_the_transport_takes_it() -> None:
    network: dict[tuple[str, int], bytes] = {}
    state = {"user": {"default": {"w": torch.arange(3.0)}}, "torchft": {"step": 5}}
    MemoryTransport(network, "sender").send_checkpoint([1], 5, state, S)
    heal = _quorum(heal=True, recover_src_replica_rank=0, recover_src_manager_address="x")
    mine = {"user": {"default": {"w": torch.zeros(3)}}}
    taker = _InPlaceMemory(network, "receiver")
    _recovery(taker, []).receive(heal, into=mine)
    assert taker.into is mine
    # A transport whose method cannot take it still heals (into fresh memory), never a TypeError.
    got = _recovery(_OldSignature(network, "receiver"), []).receive(heal, into=mine)
    assert torch.equal(got["user"]["default"]["w"], torch.arange(3.0))


# --- QuorumWorker ----------------------------------------------------------------------------


class _PG:
    def __init__(self, fail: bool = False) -> None:
        self.configured: list[tuple[str, str, int, int]] = []
        self.fail = fail

    def configure(self, addr: str, replica_id: str, rank: int, world_size: int) -> None:
        if self.fail:
            raise RuntimeError("configure failed")
        self.configured.append((addr, replica_id, rank, world_size))


def _worker(
    result: QuorumResult, pg: _PG, transport: MemoryTransport, use_async: bool = True
) -> QuorumWorker:
    return QuorumWorker(
        quorum_call=lambda ask: result,
        process_group=lambda: pg,
        recovery=_recovery(transport, []),
        snapshot=lambda captured: captured,
        metadata=transport.metadata,
        group_rank=0,
        replica_name="a",
        use_async_quorum=use_async,
        init_sync=True,
        world_size_mode=WorldSizeMode.DYNAMIC,
        min_replica_size=1,
        log=ManagerLogger(lambda: 0, "a:uuid", 0),
    )


def _request(**kw: Any) -> StepRequest:
    base: dict[str, Any] = dict(
        step=0,
        commit_failures=0,
        current_quorum_id=-1,
        allow_heal=True,
        shrink_only=False,
        timeout=S,
        captured=None,
    )
    base.update(kw)
    return StepRequest(**base)


def test_worker_reconfigures_only_on_a_new_quorum() -> None:
    pg, transport = _PG(), MemoryTransport({}, "a")
    worker = _worker(_quorum(replica_rank=0, max_replica_rank=0), pg, transport)
    outcome = worker.run(_request())
    assert outcome.reconfigured and not outcome.errors and not outcome.healing
    assert pg.configured == [("store:1/torchft/3/0", "a", 0, 2)]
    assert outcome.participation == Participation(0, 1)
    again = worker.run(_request(current_quorum_id=3))
    assert not again.reconfigured and len(pg.configured) == 1


def test_worker_reports_a_failed_configure_and_moves_no_state() -> None:
    transport = MemoryTransport({}, "a")
    worker = _worker(_quorum(recover_dst_replica_ranks=[1]), _PG(fail=True), transport)
    outcome = worker.run(_request(captured={"user": {}, "torchft": {}}))
    assert not outcome.reconfigured
    assert [str(e) for e in outcome.errors] == ["configure failed"]
    assert transport.sent == []


def test_worker_sends_and_receives_through_the_transport() -> None:
    network: dict[tuple[str, int], bytes] = {}
    src = MemoryTransport(network, "sender")
    captured = {"user": {"m": torch.ones(2)}, "torchft": {"step": 5, "batches_committed": 9}}
    sent = _worker(_quorum(recover_dst_replica_ranks=[1]), _PG(), src).run(
        _request(step=5, captured=captured)
    )
    assert not sent.errors and src.sent == [([1], 5)]
    healer = _worker(
        _quorum(heal=True, recover_src_replica_rank=0), _PG(), MemoryTransport(network, "dst")
    )
    outcome = healer.run(_request())
    assert outcome.healing and not outcome.errors
    assert outcome.received is not None
    assert torch.equal(outcome.received["user"]["m"], torch.ones(2))


def test_worker_without_captured_state_cannot_serve_a_peer() -> None:
    transport = MemoryTransport({}, "a")
    outcome = _worker(_quorum(recover_dst_replica_ranks=[1]), _PG(), transport).run(_request())
    assert "no state was captured" in str(outcome.errors[0])


# --- ManagerSettings -------------------------------------------------------------------------


def _settings(environ: dict[str, str], **kw: Any) -> ManagerSettings:
    args: dict[str, Any] = dict(
        timeout=S,
        quorum_timeout=60 * S,
        connect_timeout=S,
        quorum_retries=0,
        heartbeat_interval=timedelta(milliseconds=100),
        rank=None,
        world_size=None,
        store_addr=None,
        store_port=None,
        lighthouse_addr=None,
        port=None,
    )
    args.update(kw)
    return ManagerSettings.resolve(environ=environ, **args)


def test_settings_take_torchrun_variables_when_arguments_are_missing() -> None:
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "29500", "RANK": "2", "WORLD_SIZE": "4"}
    got = _settings({**env, "TORCHFT_LIGHTHOUSE": "http://lh:1", "TORCHFT_MANAGER_PORT": "7"})
    assert (got.store_host, got.store_port, got.group_rank, got.group_world_size) == (
        "h",
        29500,
        2,
        4,
    )
    assert (got.lighthouse_addr, got.port) == ("http://lh:1", 7)
    explicit = _settings(env, rank=0, world_size=1, store_addr="x", store_port=5, port=0)
    assert (explicit.group_rank, explicit.group_world_size, explicit.store_host) == (0, 1, "x")
    assert explicit.port == 0


def test_settings_name_a_missing_or_malformed_variable() -> None:
    with pytest.raises(KeyError, match="MASTER_ADDR"):
        _settings({"MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "1"})
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        _settings({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "two"})
