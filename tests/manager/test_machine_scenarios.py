"""Scenario tests of the Manager's step machine: text scripts drive the pure core (STYLE.md §6).

Each ``machine_scenarios/*.txt`` file is one rule of ``torchheal.manager.machine``, as the
lighthouse's scenarios are for ``quorum.py``: one rank's :class:`StepMachine` and its
:class:`Connection` receive events, and each ``expect`` checks a decision. Nothing is simulated
around them: the decisions are the real ones.

Script commands (one per line; ``#`` starts a comment):

``config min=1 retries=2 salvage warmup step=0 batches=0``
                         (first, optional) the machine's settings and starting counters.
``begin``                a step starts; ``expect warmup`` / ``expect no-warmup`` checks what it
                         said.
``quorum count=3 [rank=0] [heal] max_step=7``
                         the step's quorum arrived (``rank`` omitted: not a contributor).
``tore``                 a receive into this replica's own tensors failed part way.
``arrived batches=50 max_step=7``   a healer's state arrived.
``loaded ok|failed``     the received user state was loaded, or its load failed.
``vote [errored]``       the rank votes; ``expect vote yes|no step=N``.
``salvage [errored] [foreign] kept=2 [aborted=why] [dropped]``
                         asks the salvage rule; ``expect refusal "text"`` or ``expect redo``.
``redo``                 the group redoes the step.
``decide yes|no``        the group's decision; ``expect fatal "text"`` / ``expect no-fatal``.
``warmup_done``          the vote is asked for: ``expect warmup`` when the step was the warm-up.
``expect step=N batches=N failures=N healing=b torn=b contributes=b``  (any subset)
``notice lost|gave_up|dropped|superseded REPLICA quorum=N [steps_done=N]``
                         a lighthouse notice, heard at the machine's step; ``expect actions ...`` lists what it does
                         (``end-heal:b``, ``abort:b``, ``abort-dropped:me``, ``cancel:b``) or ``-``.
``build quorum=N members=a,b``  a process-group build starts; ``expect refused b`` / ``expect
                         started``.
``built``                the build ended; ``expect abandoned-for b`` / ``expect abandoned-for -``.
``adopt quorum=N members=a,b``  the built group is adopted; ``expect actions ...``.
``expect connected quorum=N members=a,b``  (``quorum=-1 members=-``: none).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from torchheal.coordination.plan import Participation
from torchheal.coordination.types import Notice, NoticeKind
from torchheal.manager.machine import Abort, CancelBuild, Connection, EndHeal, StepMachine

SCENARIOS = Path(__file__).parent / "machine_scenarios"


def _kv(args: list[str]) -> tuple[dict[str, str], set[str]]:
    pairs = dict(a.split("=", 1) for a in args if "=" in a)
    return pairs, {a for a in args if "=" not in a}


def _bool(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError(f"expected true or false, got {text!r}")
    return text == "true"


def _action(action: Any) -> str:
    if isinstance(action, EndHeal):
        return f"end-heal:{action.replica_id}"
    if isinstance(action, CancelBuild):
        return f"cancel:{action.replica_id}"
    assert isinstance(action, Abort)
    return f"abort{'-dropped' if action.dropped else ''}:{action.replica_id}"


class Run:
    """One script's machine, connection and the last answer of each kind."""

    def __init__(self) -> None:
        self.machine = StepMachine(
            min_replica_size=1, max_retries=None, salvage=False, warmup=False
        )
        self.connection = Connection()
        self.last: dict[str, Any] = {}

    def config(self, args: list[str]) -> None:
        kv, flags = _kv(args)
        self.machine = StepMachine(
            min_replica_size=int(kv.get("min", "1")),
            max_retries=int(kv["retries"]) if "retries" in kv else None,
            salvage="salvage" in flags,
            warmup="warmup" in flags,
        )
        self.machine.step = int(kv.get("step", "0"))
        self.machine.batches_committed = int(kv.get("batches", "0"))

    def do(self, command: str, args: list[str]) -> None:
        m, kv, flags = self.machine, *_kv(args)
        if command == "begin":
            self.last["warmup"] = m.begin()
        elif command == "warmup_done":
            self.last["warmup"] = m.end_warmup()
        elif command == "quorum":
            rank = int(kv["rank"]) if "rank" in kv else None
            self.last["untorn"] = m.quorum_taken(
                Participation(rank, int(kv["count"])),
                healing="heal" in flags,
                max_step=int(kv["max_step"]),
            )
        elif command == "tore":
            m.tore()
        elif command == "arrived":
            m.heal_arrived(int(kv["batches"]), int(kv["max_step"]))
        elif command == "loaded":
            m.loaded(ok=args[0] == "ok")
        elif command == "vote":
            self.last["vote"] = m.ballot(errored="errored" in flags or m.torn_error() is not None)
        elif command == "salvage":
            self.last["refusal"] = m.salvage_refusal(
                errored="errored" in flags,
                foreign="foreign" in flags,
                kept=int(kv.get("kept", "0")),
                aborted_for=kv.get("aborted"),
                dropped="dropped" in flags,
            )
        elif command == "redo":
            m.redo()
        elif command == "decide":
            self.last["fatal"] = m.decided(args[0] == "yes")
        elif command == "notice":
            kind = NoticeKind(args[0])
            notice = Notice(
                kind,
                args[1],
                int(kv["quorum"]),
                kv.get("reason", "gone"),
                steps_done=int(kv.get("steps_done", "0")),
            )
            self.last["actions"] = self.connection.on_notice(notice, self.machine.step)
        elif command == "build":
            members = frozenset(kv["members"].split(","))
            self.last["refused"] = self.connection.start_build(int(kv["quorum"]), members)
        elif command == "built":
            self.last["abandoned"] = self.connection.end_build()
        elif command == "adopt":
            members = frozenset(kv["members"].split(","))
            abort = self.connection.adopt(int(kv["quorum"]), members)
            self.last["actions"] = [] if abort is None else [abort]
        elif command == "expect":
            self.expect(args)
        else:
            raise ValueError(f"unknown command {command!r}")

    def expect(self, args: list[str]) -> None:
        what, rest = args[0], args[1:]
        if what in ("warmup", "no-warmup"):
            assert self.last["warmup"] is (what == "warmup")
        elif what == "untorn":
            assert self.last["untorn"] is True
        elif what == "vote":
            choice, kv = self.last["vote"], _kv(rest[1:])[0]
            assert (choice.vote, choice.step) == (rest[0] == "yes", int(kv["step"])), choice
        elif what == "refusal":
            assert self.last["refusal"] is not None and rest[0] in self.last["refusal"], self.last[
                "refusal"
            ]
        elif what == "redo":
            assert self.last["refusal"] is None, self.last["refusal"]
        elif what == "fatal":
            assert self.last["fatal"] is not None and rest[0] in self.last["fatal"]
        elif what == "no-fatal":
            assert self.last["fatal"] is None, self.last["fatal"]
        elif what == "actions":
            got = [_action(a) for a in self.last["actions"]]
            assert got == ([] if rest == ["-"] else rest), got
        elif what == "refused":
            assert self.last["refused"] == rest[0], self.last["refused"]
        elif what == "started":
            assert self.last["refused"] is None, self.last["refused"]
        elif what == "abandoned-for":
            assert self.last["abandoned"] == (None if rest[0] == "-" else rest[0])
        elif what == "connected":
            kv = _kv(rest)[0]
            members = frozenset() if kv["members"] == "-" else frozenset(kv["members"].split(","))
            assert (self.connection.quorum_id, self.connection.members) == (
                int(kv["quorum"]),
                members,
            ), (self.connection.quorum_id, self.connection.members)
        else:
            self.expect_fields(args)

    def expect_fields(self, args: list[str]) -> None:
        m = self.machine
        got = {
            "step": m.step,
            "batches": m.batches_committed,
            "failures": m.commit_failures,
            "healing": m.healing,
            "torn": m.torn,
            "contributes": m.contributes(),
            "aborted": self.connection.aborted_for is not None,
        }
        kv, flags = _kv(args)
        assert not flags, f"unknown expectation {sorted(flags)}"
        for key, text in kv.items():
            want = _bool(text) if isinstance(got[key], bool) else int(text)
            assert got[key] == want, f"{key}: got {got[key]}, want {want}"


def run_script(path: Path) -> None:
    run = Run()
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        command, *args = shlex.split(line)
        try:
            if command == "config":
                run.config(args)
            else:
                run.do(command, args)
        except AssertionError as e:
            raise AssertionError(f"{path.name}:{number}: {line}: {e}") from e


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.txt")), ids=lambda p: p.stem)
def test_scenario(path: Path) -> None:
    run_script(path)


def test_there_is_a_script_per_rule() -> None:
    assert len(list(SCENARIOS.glob("*.txt"))) >= 8
