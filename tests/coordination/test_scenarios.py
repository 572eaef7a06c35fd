"""Scenario tests: short text scripts drive a simulated lighthouse cluster (STYLE.md §6).

Each ``scenarios/*.txt`` file is one test. A :class:`Cluster` holds the pure lighthouse state, a
fake clock in integer milliseconds and a set of simulated replica groups. It does what the
lighthouse server does around the pure core: live replicas heartbeat every
``heartbeat_interval``, requesters wait for a quorum that includes them, and requesters left out of
an issued quorum are put back. Nothing else is simulated; the decisions are the real ones.

Script commands (one per line; ``#`` starts a comment; names are replica ids):

``config min_replicas=2 join_timeout=100ms heartbeat_timeout=5s heartbeat_interval=100ms``
    (first command, optional) lighthouse options; the defaults are the reference's.
``start a b``            replicas come alive and heartbeat, without asking for a quorum.
``join a step=3 [shrink_only] [commit_failures=1] [lineage=2]``
                         a (alive from now on) asks for a quorum; replaces its pending request.
                         ``lineage``: the quorum it last committed in (a torchheal session's).
``heartbeat a b``        one explicit heartbeat each (also for replicas not alive).
``kill a``               a stops heartbeating; its pending request has nobody to receive it (a
                         reference peer dying: the lighthouse learns it only from the heartbeats).
``connect a b``          a and b open torchheal sessions (alive from now on, heartbeating).
``crash a``              a dies and its session ends: the lighthouse knows at once.
``freeze a``             a stops heartbeating but its session stays open (SIGSTOP, a hung host).
``restart [persisted]``  the lighthouse dies and starts again: it forgets everything (with
                         ``persisted``, it reloads the last quorum it issued, as from its state
                         file); pending requests die with their connections; nobody is heard
                         from until it heartbeats, joins or reconnects.
``reconnect a b``        a and b open new sessions, reporting the last quorum they received.
``advance 5s``           time passes; live replicas heartbeat along the way.
``tick [500ms]``         (optionally advance first, then) one lighthouse tick.
``expect quorum 2 a,b``  the last tick issued quorum id 2 with exactly a and b.
``expect none "text"``   the last tick issued nothing, and its reason contains ``text``.
``expect reason "text"`` the last tick's reason contains ``text``.
``expect waiting a,c``   the requests still waiting (``-`` for none).
``expect lost c``        the members of the last quorum that are gone or expired (``-``: none).
``expect told c``        the members of the quorum before that the last tick's quorum left out
                         while alive and not asking: told their quorum is over (``-``: none).
``expect plan a g=0 init_sync=true rank=0 heal=false src=- dst=1,2 max_step=3 store=a``
                         a's result for the quorum a last received; ``g``/``init_sync``
                         (default 0/true) are inputs, every other key is checked: ``rank``,
                         ``world_size``, ``heal``, ``src``, ``dst``, ``max_step``, ``max_rank``,
                         ``store`` (whose TCPStore), ``quorum_id``, ``commit_failures``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from torchheal.coordination.plan import compute_quorum_results
from torchheal.coordination.quorum import (
    LighthouseConfig,
    LighthouseState,
    heartbeat,
    join,
    left_out,
    lost_members,
    requeue,
    restore,
    session_ended,
    session_opened,
    tick,
)
from torchheal.coordination.types import Quorum, QuorumMember, Timestamp

SCENARIOS = sorted((Path(__file__).parent / "scenarios").glob("*.txt"))
WALL_EPOCH_S = 1_700_000_000


class ScriptError(AssertionError):
    """A script line failed: a bad command or an unmet expectation."""


def parse_duration_ms(text: str) -> int:
    """Parse ``250ms``, ``5s`` or ``1.5s`` into whole milliseconds."""
    if text.endswith("ms"):
        return int(text[:-2])
    if text.endswith("s"):
        return round(float(text[:-1]) * 1000)
    raise ScriptError(f"bad duration {text!r}: use e.g. 250ms or 5s")


def parse_names(text: str) -> list[str]:
    return [] if text == "-" else text.split(",")


def parse_bool(text: str) -> bool:
    if text not in ("true", "false"):
        raise ScriptError(f"bad boolean {text!r}: use true or false")
    return text == "true"


def parse_kv(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """Split ``name flag key=value`` words into bare words and key/value pairs."""
    words, pairs = [], {}
    for arg in args:
        if "=" in arg:
            key, value = arg.split("=", 1)
            pairs[key] = value
        else:
            words.append(arg)
    return words, pairs


def member_for(name: str, step: int, shrink_only: bool, commit_failures: int) -> QuorumMember:
    return QuorumMember(
        replica_id=name,
        address=f"http://{name}:29500",
        store_address=f"{name}:29600",
        step=step,
        world_size=1,
        shrink_only=shrink_only,
        commit_failures=commit_failures,
    )


@dataclass
class Cluster:
    """A lighthouse and its replica groups under a fake clock."""

    config: LighthouseConfig = field(default_factory=lambda: LighthouseConfig(min_replicas=1))
    heartbeat_interval_ms: int = 100
    now_ms: int = 0
    state: LighthouseState = field(default_factory=LighthouseState)
    alive: set[str] = field(default_factory=set)
    waiting: dict[str, QuorumMember] = field(default_factory=dict)
    received: dict[str, Quorum] = field(default_factory=dict)
    last_quorum: Quorum | None = None
    last_reason: str | None = None
    # The last quorum the lighthouse issued (what its state file would hold).
    last_issued: Quorum | None = None
    # Who the last tick's quorum left out alive (the lighthouse tells them; ``left_out``).
    told: list[str] = field(default_factory=list)

    @property
    def now(self) -> float:
        return self.now_ms / 1000.0

    def advance(self, duration_ms: int) -> None:
        # Heartbeats land on the interval grid, as from a manager's heartbeat loop.
        end = self.now_ms + duration_ms
        while self.now_ms < end:
            self.now_ms = min(end, self.now_ms + self.heartbeat_interval_ms)
            for name in sorted(self.alive):
                heartbeat(self.state, name, self.now)

    def tick(self) -> None:
        wall = Timestamp.from_float(WALL_EPOCH_S + self.now)
        before = self.state.prev_quorum
        quorum, reason = tick(self.state, self.config, self.now, wall)
        self.last_quorum, self.last_reason = quorum, reason
        self.told = []
        if quorum is None:
            return
        self.last_issued = quorum
        members = {m.replica_id for m in quorum.participants}
        for name, request in sorted(self.waiting.items()):
            if name in members:
                self.received[name] = quorum
                del self.waiting[name]
            else:
                # As the server does: a requester left out keeps waiting for the next quorum.
                requeue(self.state, request, self.now)
        self.told = left_out(self.state, before, quorum)


def run_command(cluster: Cluster, words: list[str]) -> None:
    """Apply one script command to ``cluster``; raise ScriptError if it fails."""
    cmd, args = words[0], words[1:]
    if cmd == "config":
        _, pairs = parse_kv(args)
        options: dict[str, int] = {}
        for key, value in pairs.items():
            if key == "min_replicas":
                options[key] = int(value)
            elif key in ("join_timeout", "heartbeat_timeout", "quorum_tick"):
                options[f"{key}_ms"] = parse_duration_ms(value)
            elif key == "heartbeat_interval":
                cluster.heartbeat_interval_ms = parse_duration_ms(value)
            else:
                raise ScriptError(f"unknown config key {key!r}")
        cluster.config = LighthouseConfig(**{"min_replicas": 1, **options})
        cluster.config.validate()
    elif cmd == "start":
        cluster.alive.update(args)
        for name in args:
            heartbeat(cluster.state, name, cluster.now)
    elif cmd == "join":
        names, pairs = parse_kv(args)
        name = names[0]
        request = member_for(
            name,
            step=int(pairs.get("step", "0")),
            shrink_only="shrink_only" in names[1:],
            commit_failures=int(pairs.get("commit_failures", "0")),
        )
        cluster.alive.add(name)
        cluster.waiting[name] = request
        join(cluster.state, request, cluster.now, int(pairs.get("lineage", "0")))
    elif cmd == "heartbeat":
        for name in args:
            heartbeat(cluster.state, name, cluster.now)
    elif cmd == "kill":
        for name in args:
            cluster.alive.discard(name)
            cluster.waiting.pop(name, None)
    elif cmd == "connect":
        cluster.alive.update(args)
        for name in args:
            session_opened(cluster.state, name, cluster.now)
    elif cmd == "crash":
        for name in args:
            cluster.alive.discard(name)
            cluster.waiting.pop(name, None)
            session_ended(cluster.state, name)
    elif cmd == "restart":
        if args not in ([], ["persisted"]):
            raise ScriptError(f"restart takes nothing or 'persisted', got {args}")
        cluster.state = LighthouseState()
        cluster.alive.clear()
        cluster.waiting.clear()
        if args and cluster.last_issued is not None:
            restore(cluster.state, cluster.last_issued, cluster.now)
    elif cmd == "reconnect":
        cluster.alive.update(args)
        for name in args:
            session_opened(cluster.state, name, cluster.now)
            if name in cluster.received:
                restore(cluster.state, cluster.received[name], cluster.now)
    elif cmd == "freeze":
        for name in args:
            cluster.alive.discard(name)
    elif cmd == "advance":
        cluster.advance(parse_duration_ms(args[0]))
    elif cmd == "tick":
        if args:
            cluster.advance(parse_duration_ms(args[0]))
        cluster.tick()
    elif cmd == "expect":
        check_expectation(cluster, args)
    else:
        raise ScriptError(f"unknown command {cmd!r}")


def check_expectation(cluster: Cluster, args: list[str]) -> None:
    what, rest = args[0], args[1:]
    if what in ("quorum", "none", "reason") and cluster.last_reason is None:
        raise ScriptError("no tick has run yet")
    if what == "quorum":
        want_id, want_names = int(rest[0]), parse_names(rest[1])
        got = cluster.last_quorum
        if got is None:
            raise ScriptError(f"expected quorum {want_id}, got none: {cluster.last_reason}")
        got_names = [m.replica_id for m in got.participants]
        if (got.quorum_id, got_names) != (want_id, want_names):
            raise ScriptError(
                f"expected quorum {want_id} {want_names}, got {got.quorum_id} {got_names}"
            )
    elif what == "none":
        if cluster.last_quorum is not None:
            raise ScriptError(f"expected no quorum, got {cluster.last_quorum}")
        if rest and rest[0] not in cluster.last_reason:  # type: ignore[operator]
            raise ScriptError(f"reason {cluster.last_reason!r} lacks {rest[0]!r}")
    elif what == "reason":
        if rest[0] not in cluster.last_reason:  # type: ignore[operator]
            raise ScriptError(f"reason {cluster.last_reason!r} lacks {rest[0]!r}")
    elif what == "waiting":
        want = sorted(parse_names(rest[0]))
        if sorted(cluster.waiting) != want:
            raise ScriptError(f"expected waiting {want}, got {sorted(cluster.waiting)}")
    elif what == "lost":
        want = sorted(parse_names(rest[0]))
        got = lost_members(cluster.state, cluster.config, cluster.now)
        if got != want:
            raise ScriptError(f"expected lost {want}, got {got}")
    elif what == "told":
        want = sorted(parse_names(rest[0]))
        if cluster.told != want:
            raise ScriptError(f"expected told {want}, got {cluster.told}")
    elif what == "plan":
        check_plan(cluster, rest)
    else:
        raise ScriptError(f"unknown expectation {what!r}")


def check_plan(cluster: Cluster, args: list[str]) -> None:
    names, pairs = parse_kv(args)
    name = names[0]
    if name not in cluster.received:
        raise ScriptError(f"{name} has not received a quorum")
    quorum = cluster.received[name]
    group_rank = int(pairs.pop("g", "0"))
    init_sync = parse_bool(pairs.pop("init_sync", "true"))
    result = compute_quorum_results(name, group_rank, quorum, init_sync)
    ids = result.replica_ids

    def rank_or_dash(rank: int | None) -> str:
        return "-" if rank is None else str(rank)

    got = {
        "rank": str(result.replica_rank),
        "world_size": str(result.replica_world_size),
        "heal": str(result.heal).lower(),
        "src": rank_or_dash(result.recover_src_replica_rank),
        "dst": ",".join(map(str, result.recover_dst_replica_ranks)) or "-",
        "max_step": str(result.max_step),
        "max_rank": rank_or_dash(result.max_replica_rank),
        "store": {f"{i}:29600": i for i in ids}.get(result.store_address, result.store_address),
        "quorum_id": str(result.quorum_id),
        "commit_failures": str(result.commit_failures),
    }
    for key, want in pairs.items():
        if key not in got:
            raise ScriptError(f"unknown plan key {key!r}")
        if got[key] != want:
            raise ScriptError(f"plan of {name} (g={group_rank}): {key}={got[key]}, expected {want}")
    if result.heal:
        # The address must point at the source's manager, not just carry its rank.
        src = ids[result.recover_src_replica_rank]  # type: ignore[index]
        if result.recover_src_manager_address != f"http://{src}:29500":
            raise ScriptError(f"bad source address {result.recover_src_manager_address!r}")


def run_script(path: Path) -> int:
    """Run every command of a script; return how many expectations were checked."""
    cluster = Cluster()
    checked = 0
    for lineno, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = shlex.split(line)
        try:
            run_command(cluster, words)
        except (ScriptError, ValueError, IndexError, KeyError) as exc:
            raise ScriptError(f"{path.name}:{lineno}: {line}\n  -> {exc}") from exc
        checked += words[0] == "expect"
    return checked


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_scenario(path: Path) -> None:
    assert run_script(path) > 0, f"{path.name} checks nothing"


def test_scenarios_exist() -> None:
    assert len(SCENARIOS) >= 7


def test_runner_reports_failed_expectation(tmp_path: Path) -> None:
    script = tmp_path / "bad.txt"
    script.write_text("join a\ntick\nexpect quorum 2 a\n")
    with pytest.raises(ScriptError, match=r"bad.txt:3: expect quorum 2 a"):
        run_script(script)
