"""Property: a group's quorum id never goes backwards or changes meaning across restarts (issue 12).

Random histories of rounds (some groups ask, ticks run) and lighthouse restarts, some in the
middle of delivering a quorum (only some of its members got it). Each group
remembers the last quorum it received; a restart gives the lighthouse a fresh state, and a group
reports what it remembers when its session reopens (``quorum.restore``), before any request.
Checked for every member of every issued quorum: the id is at least the one it holds, and equal
only for the very same members all of whom hold it (a group keeps its process group when the id
does not change, so that group must be whole).

Not promised without a store: a group that never comes back may hold an id that a restarted
lighthouse issues again to others (harmless: nobody uses both); ``--state-file``/etcd make ids
globally monotonic (``tests/lighthouse_restart/test_store.py``).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchheal.coordination.quorum import (
    LighthouseConfig,
    LighthouseState,
    heartbeat,
    join,
    requeue,
    restore,
    session_opened,
    tick,
)
from torchheal.coordination.types import Quorum, QuorumMember, Timestamp

NAMES = ("a", "b", "c")
CONFIG = LighthouseConfig(min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000)

ops = st.lists(
    st.one_of(
        # these groups ask, then ticks run until a quorum is issued or 2 s passed
        st.tuples(st.just("round"), st.sets(st.sampled_from(NAMES), min_size=1)),
        st.tuples(st.just("restart"), st.just(frozenset())),
        # the lighthouse dies while delivering its next quorum: only these members get it
        st.tuples(st.just("crash_delivering"), st.sets(st.sampled_from(NAMES))),
        st.tuples(st.just("reconnect"), st.sets(st.sampled_from(NAMES), min_size=1)),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_ids_never_go_backwards_or_repeat_across_restarts(history: list) -> None:
    state = LighthouseState()
    now = 0.0
    held: dict[str, Quorum] = {}  # each group's last received quorum
    connected: set[str] = set()

    def reconnect(name: str) -> None:
        connected.add(name)
        session_opened(state, name, now)
        if name in held:
            restore(state, held[name], now)

    partial: set[str] | None = None
    for op, names in history:
        if op == "crash_delivering":
            partial = set(names)
        elif op == "restart":
            state = LighthouseState()  # requests die with their connections
            connected.clear()
        elif op == "reconnect":
            for name in sorted(names):
                reconnect(name)
        else:
            waiting = {}
            for name in sorted(names):
                if name not in connected:
                    reconnect(name)  # a torchheal group's request travels on its session
                waiting[name] = QuorumMember(replica_id=name, step=0)
                join(state, waiting[name], now)
            for _ in range(20):
                now += 0.1
                for name in connected:
                    heartbeat(state, name, now)
                quorum, _ = tick(state, CONFIG, now, Timestamp.from_float(now))
                if quorum is None:
                    continue
                ids = tuple(m.replica_id for m in quorum.participants)
                for name in ids:
                    if name not in held:
                        continue
                    mine = held[name]
                    # Never backwards for a member; the same id only for the same members (the
                    # member keeps its process group when the id does not change).
                    assert quorum.quorum_id >= mine.quorum_id, (name, mine.quorum_id, quorum)
                    if quorum.quorum_id == mine.quorum_id:
                        assert tuple(m.replica_id for m in mine.participants) == ids, quorum
                        # ... and only if every member holds it: its process group is whole.
                        assert all(
                            n in held and held[n].quorum_id == quorum.quorum_id for n in ids
                        ), (quorum, {n: held[n].quorum_id for n in ids if n in held})
                if partial is not None:
                    # The lighthouse died while sending it: some members never got it.
                    for name in ids:
                        if name in partial:
                            held[name] = quorum
                    partial = None
                    state = LighthouseState()
                    connected.clear()
                    break
                for name in ids:
                    held[name] = quorum
                    waiting.pop(name, None)
                if not waiting:
                    break
                for member in waiting.values():
                    requeue(state, member, now)
