"""Interop with the reference (torchft) coordination plane, over real loopback sockets.

Two directions, as the wire-compatibility promise requires:

1. the reference's ``LighthouseClient`` and ``ManagerServer``/``ManagerClient`` against a
   torchheal ``LighthouseServer``;
2. torchheal's ``ManagerServer``/``ManagerClient`` and ``LighthouseClient`` against the
   reference's ``LighthouseServer``;

plus mixed quorums (one reference and one torchheal manager server on one lighthouse, ranks of
one group using clients of both implementations). Every scripted sequence of requests is run
all-reference first; each other combination must produce the same quorums (ids, members in
order, every member field) and the same per-rank quorum results, votes and errors. The
all-reference run is itself checked against the rules of the behaviour doc (§4, §5), so two
implementations that agree on a wrong answer still fail.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

import torchheal.coordination as heal_mod
from tests.interop.helpers import (
    CONNECT,
    Cluster,
    Impl,
    gather,
    manager_quorum,
    norm_quorum,
    norm_result,
    wait_registered,
)
from tests.reference import import_reference

ref_mod = import_reference("torchft.coordination")

pytestmark = [pytest.mark.interop, pytest.mark.timeout(60)]

HEAL = Impl("torchheal", heal_mod)
REF = Impl("reference", ref_mod)
TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


# =============================================================================================
# Lighthouse: the same LighthouseClient.quorum sequence against either lighthouse


def lighthouse_sequence(lh_impl: Impl, clients: dict[str, Impl]) -> list[dict[str, Any]]:
    """Run the scripted join/grow/shrink sequence; returns each round's quorum per requester.

    Replicas a, b, c, d; the lighthouse needs 2. Rounds:
      1. a, b join at step 0                        -> new quorum {a, b}
      2. a, b again at step 1, a with data          -> same id (membership unchanged)
      3. c asks first, then a, b (fast path grows)  -> new quorum {a, b, c}
      4. d asks first, then a (shrink_only), b, c   -> {a, b, c}, same id; d keeps waiting
      5. a, b, c again (d still waiting)            -> new quorum {a, b, c, d}; d gets it too
    """
    cluster = Cluster()
    try:
        server, addr = cluster.lighthouse(lh_impl, min_replicas=2)
        conn = {rid: impl.mod.LighthouseClient(addr, CONNECT) for rid, impl in clients.items()}

        def ask(rid: str, step: int, **kwargs: Any) -> Any:
            return cluster.submit(
                conn[rid].quorum,
                rid,
                TIMEOUT,
                address=f"http://mgr-{rid}:1",
                store_address=f"store-{rid}:2",
                step=step,
                world_size=ord(rid) - ord("a") + 1,
                **kwargs,
            )

        rounds: list[dict[str, Any]] = []
        started = time.time()

        def record(futures: dict[str, Any]) -> None:
            quorums = dict(zip(futures, gather(futures.values()), strict=True))
            for q in quorums.values():
                created = q.created.seconds + q.created.nanos / 1e9
                # A wall-clock time of issue: within this run (1 s slack for rounding).
                assert started - 1 <= created <= time.time() + 1, created
            rounds.append({rid: norm_quorum(q) for rid, q in quorums.items()})

        record({"a": ask("a", 0), "b": ask("b", 0)})
        record({"a": ask("a", 1, data={"my_data": 1234, "nested": [1, "x"]}), "b": ask("b", 1)})
        fc = ask("c", 0)
        wait_registered(lh_impl, server, 1)
        record({"a": ask("a", 2), "b": ask("b", 2), "c": fc})
        fd = ask("d", 0)
        wait_registered(lh_impl, server, 1)
        record({"a": ask("a", 3, shrink_only=True), "b": ask("b", 3), "c": ask("c", 3)})
        assert not fd.done(), "d must not be in a shrink-only quorum"
        # d re-registers itself after being left out; wait for that so round 5 is deterministic.
        wait_registered(lh_impl, server, 1)
        record({"a": ask("a", 4), "b": ask("b", 4), "c": ask("c", 4), "d": fd})
        return rounds
    finally:
        cluster.close()


def _member(rid: str, step: int, data: Any = None, shrink_only: bool = False) -> tuple[Any, ...]:
    return (rid, f"http://mgr-{rid}:1", f"store-{rid}:2", step, ord(rid) - 96, shrink_only, data)


def _expected_lighthouse_rounds() -> list[dict[str, Any]]:
    """What §4 says the sequence must give (quorum id, members sorted by replica id)."""
    data = {"my_data": 1234, "nested": [1, "x"]}
    r1 = (1, (_member("a", 0), _member("b", 0)))
    r2 = (1, (_member("a", 1, data), _member("b", 1)))
    r3 = (2, (_member("a", 2), _member("b", 2), _member("c", 0)))
    r4 = (2, (_member("a", 3, shrink_only=True), _member("b", 3), _member("c", 3)))
    r5 = (3, (_member("a", 4), _member("b", 4), _member("c", 4), _member("d", 0)))
    return [
        {"a": r1, "b": r1},
        {"a": r2, "b": r2},
        {"a": r3, "b": r3, "c": r3},
        {"a": r4, "b": r4, "c": r4},
        {"a": r5, "b": r5, "c": r5, "d": r5},
    ]


@pytest.fixture(scope="module")
def reference_lighthouse_rounds() -> list[dict[str, Any]]:
    return lighthouse_sequence(REF, dict.fromkeys("abcd", REF))


def test_reference_lighthouse_sequence_follows_the_rules(
    reference_lighthouse_rounds: list[dict[str, Any]],
) -> None:
    assert reference_lighthouse_rounds == _expected_lighthouse_rounds()


@pytest.mark.parametrize(
    ("lh_impl", "clients"),
    [
        pytest.param(HEAL, dict.fromkeys("abcd", HEAL), id="torchheal-lh+torchheal-clients"),
        pytest.param(HEAL, dict.fromkeys("abcd", REF), id="torchheal-lh+reference-clients"),
        pytest.param(REF, dict.fromkeys("abcd", HEAL), id="reference-lh+torchheal-clients"),
        pytest.param(
            HEAL, {"a": REF, "b": HEAL, "c": REF, "d": HEAL}, id="torchheal-lh+mixed-clients"
        ),
        pytest.param(
            REF, {"a": HEAL, "b": REF, "c": HEAL, "d": REF}, id="reference-lh+mixed-clients"
        ),
    ],
)
def test_lighthouse_sequence_matches_reference(
    lh_impl: Impl, clients: dict[str, Impl], reference_lighthouse_rounds: list[dict[str, Any]]
) -> None:
    rounds = lighthouse_sequence(lh_impl, clients)
    for i, (got, want) in enumerate(zip(rounds, reference_lighthouse_rounds, strict=True)):
        assert got == want, f"round {i + 1} differs from the reference"


@pytest.mark.parametrize(("lh_impl", "client_impl"), [(HEAL, REF), (REF, HEAL), (HEAL, HEAL)])
def test_heartbeat_expiry_drops_silent_member(
    cluster: Cluster, lh_impl: Impl, client_impl: Impl
) -> None:
    # Long join timeout so the first quorum deterministically waits for b (a heartbeating
    # straggler); a heartbeat timeout short enough that b, once silent, ages out within the
    # test, yet long enough that a and b stay healthy while the first round forms.
    server, addr = cluster.lighthouse(
        lh_impl, min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=1000
    )
    client = client_impl.mod.LighthouseClient(addr, CONNECT)
    client.heartbeat("b")
    first = gather(
        [
            cluster.submit(client.quorum, "a", TIMEOUT),
            _after_registered(cluster, lh_impl, server, 1, lambda: client.quorum("b", TIMEOUT)),
        ]
    )
    assert [norm_quorum(q) for q in first] == [
        (1, (("a", "", "", 0, 0, False, None), ("b", "", "", 0, 0, False, None)))
    ] * 2
    # b is silent from now on while a keeps heartbeating, as its manager server would. a's
    # request waits (split-brain guard: 1 of 2 heartbeating) until b's heartbeat is 1 s old,
    # then gets a quorum without b under a new id.
    stop = threading.Event()

    def heartbeat_a() -> None:
        while not stop.wait(0.1):
            client.heartbeat("a")

    beating = cluster.submit(heartbeat_a)
    try:
        second = client.quorum("a", TIMEOUT, step=1)
    finally:
        stop.set()
    beating.result(timeout=5)
    assert norm_quorum(second) == (2, (("a", "", "", 1, 0, False, None),))


def _after_registered(cluster: Cluster, impl: Impl, server: Any, count: int, fn: Any) -> Any:
    """Submit ``fn`` once the lighthouse holds ``count`` requests."""
    wait_registered(impl, server, count)
    return cluster.submit(fn)


@pytest.mark.parametrize(
    ("lh_impl", "client_impl"), [(HEAL, REF), (REF, HEAL), (HEAL, HEAL), (REF, REF)]
)
def test_lighthouse_quorum_timeout_is_timeout_error(
    cluster: Cluster, lh_impl: Impl, client_impl: Impl
) -> None:
    _, addr = cluster.lighthouse(lh_impl, min_replicas=2)
    client = client_impl.mod.LighthouseClient(addr, CONNECT)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        client.quorum("lonely", timedelta(milliseconds=10))
    # Bounded: the deadline is enforced, not waited out to some default.
    assert time.monotonic() - started < 5


# =============================================================================================
# Manager servers: two replica groups, one or two ranks each, several rounds

RIDS = ("replica_0", "replica_1")
# Steps only move forward after a committed vote, as in training: torchheal's manager server
# rejects a vote for a step it already committed (the reference ignores the step).
# (init_sync, {replica_id: (step, commit_failures)}, {replica_id: vote of the group's last rank})
MANAGER_ROUNDS: list[tuple[bool, dict[str, tuple[int, int]], dict[str, bool]]] = [
    (False, {"replica_0": (0, 0), "replica_1": (0, 0)}, {"replica_0": False, "replica_1": False}),
    (True, {"replica_0": (0, 0), "replica_1": (0, 0)}, {"replica_0": True, "replica_1": True}),
    (True, {"replica_0": (5, 0), "replica_1": (3, 0)}, {"replica_0": True, "replica_1": False}),
    (False, {"replica_0": (6, 0), "replica_1": (6, 2)}, {"replica_0": True, "replica_1": False}),
    (False, {"replica_0": (7, 0), "replica_1": (6, 0)}, {"replica_0": True, "replica_1": True}),
]

Setup = tuple[Impl, dict[str, tuple[Impl, list[Impl]]]]


def manager_sequence(setup: Setup, world_size: int) -> list[dict[str, Any]]:
    """Run MANAGER_ROUNDS; returns per round and per (replica, rank): result, vote, metadata.

    Args:
        setup: the lighthouse implementation and, per replica group, the manager server
            implementation and the client implementation of each group rank.
        world_size: ranks per replica group.
    """
    lh_impl, groups = setup
    cluster = Cluster()
    try:
        _, lh_addr = cluster.lighthouse(lh_impl, min_replicas=2)
        servers = {
            rid: cluster.manager(impl, rid, lh_addr, f"store-{rid}:1234", world_size)
            for rid, (impl, _) in groups.items()
        }
        owners = {server.address(): rid for rid, server in servers.items()}
        ranks = [(rid, g) for rid in RIDS for g in range(world_size)]
        impl_of = {(rid, g): groups[rid][1][g] for rid, g in ranks}
        clients = {
            key: impl_of[key].mod.ManagerClient(servers[key[0]].address(), CONNECT) for key in ranks
        }
        out: list[dict[str, Any]] = []
        for init_sync, steps, votes in MANAGER_ROUNDS:
            futures = [
                cluster.submit(
                    manager_quorum,
                    impl_of[(rid, g)],
                    clients[(rid, g)],
                    g,
                    steps[rid][0],
                    f"meta-{rid}-{g}-{steps[rid][0]}",
                    False,
                    init_sync,
                    steps[rid][1],
                    TIMEOUT,
                    replica_id=rid,
                )
                for rid, g in ranks
            ]
            results = dict(zip(ranks, gather(futures), strict=True))
            round_out: dict[str, Any] = {}
            for key, result in results.items():
                entry = norm_result(result, owners)
                if result.recover_src_manager_address:
                    # What a healing rank does: ask the source group's server for the metadata
                    # of its own group rank, with a client of its own implementation.
                    src = impl_of[key].mod.ManagerClient(
                        result.recover_src_manager_address, CONNECT
                    )
                    entry["fetched_metadata"] = src._checkpoint_metadata(key[1], TIMEOUT)
                    if hasattr(src, "close"):  # torchheal's client; the reference has none
                        src.close()
                round_out[f"{key[0]}/{key[1]}"] = entry
            vote_futures = [
                cluster.submit(
                    clients[(rid, g)].should_commit,
                    g,
                    steps[rid][0],
                    votes[rid] or g != world_size - 1,
                    TIMEOUT,
                )
                for rid, g in ranks
            ]
            for (rid, g), decision in zip(ranks, gather(vote_futures), strict=True):
                round_out[f"{rid}/{g}"]["should_commit"] = decision
            out.append(round_out)
        return out
    finally:
        cluster.close()


def _expected_manager_rounds(world_size: int) -> list[dict[str, Any]]:
    """§5 applied by hand to MANAGER_ROUNDS (replica_0 sorts before replica_1)."""

    def result(**fields: Any) -> dict[str, Any]:
        base = {
            "replica_world_size": 2,
            "recover_src_replica_rank": None,
            "recover_dst_replica_ranks": [],
            "heal": False,
            "recover_src": "",
            "should_commit": True,
        }
        return {**base, **fields}

    rounds: list[dict[str, Any]] = []
    for index, (init_sync, steps, votes) in enumerate(MANAGER_ROUNDS):
        quorum_id = 2 if index >= 3 else 1  # round 3 reports commit failures: a new id
        max_step = max(s for s, _ in steps.values())
        up = [rid for rid in RIDS if steps[rid][0] == max_step]
        force = init_sync and max_step == 0
        round_out: dict[str, Any] = {}
        for g in range(world_size):
            primary = up[g % len(up)]
            behind = [
                i
                for i, rid in enumerate(RIDS)
                if steps[rid][0] != max_step or (force and rid != primary)
            ]
            fresh = [i for i in range(2) if i not in behind]
            assign: dict[int, list[int]] = {}
            src_of: dict[int, int] = {}
            for k, r in enumerate(behind):
                src = fresh[(k + g) % len(fresh)]
                assign.setdefault(src, []).append(r)
                src_of[r] = src
            for i, rid in enumerate(RIDS):
                entry = result(
                    quorum_id=quorum_id,
                    replica_rank=i,
                    max_step=max_step,
                    max_replica_rank=up.index(rid) if rid in up else None,
                    max_world_size=len(up),
                    store_address=f"store-{primary}:1234",
                    recover_dst_replica_ranks=assign.get(i, []),
                    should_commit=votes[rid],
                )
                if i in src_of:
                    src_rid = RIDS[src_of[i]]
                    entry.update(
                        heal=True,
                        recover_src_replica_rank=src_of[i],
                        recover_src=src_rid,
                        fetched_metadata=f"meta-{src_rid}-{g}-{steps[src_rid][0]}",
                    )
                round_out[f"{rid}/{g}"] = entry
        rounds.append(round_out)
    return rounds


def _all(lh: Impl, mgr: Impl, world_size: int) -> Setup:
    return lh, {rid: (mgr, [mgr] * world_size) for rid in RIDS}


def _mixed(lh: Impl, first: Impl, second: Impl, world_size: int) -> Setup:
    """replica_0 served by ``first``, replica_1 by ``second``; with two ranks, rank 1 of each
    group uses the other implementation's client."""
    return lh, {
        "replica_0": (first, [first, second][:world_size]),
        "replica_1": (second, [second, first][:world_size]),
    }


_reference_manager_cache: dict[int, list[dict[str, Any]]] = {}


def reference_manager_rounds(world_size: int) -> list[dict[str, Any]]:
    if world_size not in _reference_manager_cache:
        _reference_manager_cache[world_size] = manager_sequence(
            _all(REF, REF, world_size), world_size
        )
    return _reference_manager_cache[world_size]


@pytest.mark.parametrize("world_size", [1, 2])
def test_reference_manager_sequence_follows_the_rules(world_size: int) -> None:
    assert reference_manager_rounds(world_size) == _expected_manager_rounds(world_size)


SETUPS = {
    "all-torchheal": lambda w: _all(HEAL, HEAL, w),
    "reference-managers-on-torchheal-lh": lambda w: _all(HEAL, REF, w),
    "torchheal-managers-on-reference-lh": lambda w: _all(REF, HEAL, w),
    "mixed-managers-on-reference-lh": lambda w: _mixed(REF, REF, HEAL, w),
    "mixed-managers-on-torchheal-lh": lambda w: _mixed(HEAL, HEAL, REF, w),
}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("setup_name", list(SETUPS))
def test_manager_sequence_matches_reference(setup_name: str, world_size: int) -> None:
    rounds = manager_sequence(SETUPS[setup_name](world_size), world_size)
    want = reference_manager_rounds(world_size)
    for i, (got, expected) in enumerate(zip(rounds, want, strict=True)):
        for key in expected:
            assert got[key] == expected[key], f"round {i}, {key} differs from the reference"


def test_torchheal_lighthouse_echoes_reference_reconfigure_handles(cluster: Cluster) -> None:
    """Reference managers put per-rank handles in a QuorumMember field torchheal does not know;
    a torchheal lighthouse must hand them back untouched, as the reference lighthouse does."""

    def handles(lh_impl: Impl) -> list[Any]:
        _, lh_addr = cluster.lighthouse(lh_impl, min_replicas=2)
        clients = []
        for rid in RIDS:
            server = cluster.manager(REF, rid, lh_addr, f"store-{rid}:1", 1)
            clients.append(REF.mod.ManagerClient(server.address(), CONNECT))
        futures = [
            cluster.submit(manager_quorum, REF, c, 0, 1, "", False, False, 0, TIMEOUT, rid)
            for c, rid in zip(clients, RIDS, strict=True)
        ]
        return [(list(r.replica_ids), list(r.reconfigure_handles)) for r in gather(futures)]

    expected = (list(RIDS), ["handle-replica_0-0", "handle-replica_1-0"])
    assert handles(REF) == [expected, expected]
    assert handles(HEAL) == [expected, expected]


@pytest.mark.parametrize(
    ("lh_impl", "mgr_impl"), [(HEAL, REF), (REF, HEAL), (HEAL, HEAL), (REF, REF)]
)
def test_manager_quorum_timeout_is_timeout_error(
    cluster: Cluster, lh_impl: Impl, mgr_impl: Impl
) -> None:
    # One group on a lighthouse that needs two: no quorum can form within 10 ms.
    _, lh_addr = cluster.lighthouse(lh_impl, min_replicas=2)
    server = cluster.manager(mgr_impl, "replica_0", lh_addr, "store:1", 1)
    client = mgr_impl.mod.ManagerClient(server.address(), CONNECT)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        manager_quorum(
            mgr_impl, client, 0, 0, "", False, True, 0, timedelta(milliseconds=10), "replica_0"
        )
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("server_impl", "client_impl"), [(HEAL, REF), (REF, HEAL), (HEAL, HEAL), (REF, REF)]
)
def test_unknown_checkpoint_rank_is_runtime_error(
    cluster: Cluster, server_impl: Impl, client_impl: Impl
) -> None:
    _, lh_addr = cluster.lighthouse(server_impl, min_replicas=1)
    server = cluster.manager(server_impl, "replica_0", lh_addr, "store:1", 1)
    client = client_impl.mod.ManagerClient(server.address(), CONNECT)
    with pytest.raises(RuntimeError, match="rank not found"):
        client._checkpoint_metadata(0, TIMEOUT)
