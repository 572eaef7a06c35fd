"""Scenario tests of the divergence guard's pure core (``torchheal.manager.divergence``).

Each ``divergence_scenarios/*.txt`` file is one rule: which settings the quorum's replica ids
advertise alike, when an exchange is due, and the verdict (reference class, who repairs, which
keys differ). Replica ids are made by ``advertise`` and read by ``agreed``, slots go through the
real word layout (``encode`` then ``decode``), as the Manager and the exchange do.

Script commands (one per line; ``#`` starts a comment):

``config interval=N policy=P``   this member's settings (a fresh schedule).
``quorum id=N step=N [heals] [peers=P,..]``
                                 this step's quorum: this member and one peer per ``P`` (default
                                 ``same``): ``same`` advertises this member's settings,
                                 ``interval:N``, ``policy:P`` or ``format:N`` others,
                                 ``reference`` a reference group's id (a uuid4), ``name`` an id
                                 without a uuid; ``expect due quorum|heal|interval|-``.
``slot rank=N [interval=N] [policy=P] step=N [last_heal=N] (state=k:v,... | ineligible)``
                                 one member's part of the exchange (its fingerprint entries are
                                 made from the ``key:value`` pairs).
``verdict then=N now=N [ended]``  the next check, in quorum ``now``, of an exchange started in
                                 quorum ``then`` (whose sum is in: ``ended``); ``expect awaited
                                 yes|no``.
``judge step=N``                 the verdict on the slots so far; ``expect verdict matched
                                 compared=0,..`` or ``expect verdict reference=.. repair=..
                                 rule=..``; ``expect differing RANK:key,key``.
"""

from __future__ import annotations

import shlex
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from torchheal.manager import divergence
from torchheal.manager.divergence import (
    POLICIES,
    GuardSettings,
    Schedule,
    Slot,
    Verdict,
    advertise,
    advertised,
    agreed,
    decode,
    differing_tensors,
    encode,
    judge,
    name_hash,
    slot_words,
    tensor_count,
    tensor_words,
    verdict_awaited,
)

SCENARIOS = Path(__file__).parent / "divergence_scenarios"


def _kv(args: list[str]) -> tuple[dict[str, str], set[str]]:
    return dict(a.split("=", 1) for a in args if "=" in a), {a for a in args if "=" not in a}


def _ranks(text: str) -> tuple[int, ...]:
    return tuple(int(r) for r in text.split(",")) if text else ()


def _peer(spec: str, mine: GuardSettings, rng: int) -> str:
    """A peer's replica id as ``quorum ... peers=`` describes it."""
    if spec == "reference":
        return f"ref:{uuid.UUID(int=rng, version=4)}"
    if spec == "name":
        return "plain-name"
    settings, fmt = mine, divergence.FORMAT
    if spec.startswith("interval:"):
        settings = replace(mine, interval=int(spec.split(":")[1]))
    elif spec.startswith("policy:"):
        settings = replace(mine, policy=spec.split(":")[1])
    elif spec.startswith("format:"):
        fmt = int(spec.split(":")[1])
    elif spec != "same":
        raise ValueError(f"unknown peer {spec!r}")
    suffix = advertise(settings, rng)
    if fmt != divergence.FORMAT:  # rewrite the format field (bits 52-61)
        value = uuid.UUID(suffix).int & ~(0x3FF << 52) | fmt << 52
        suffix = str(uuid.UUID(int=value))
    return f"peer:{suffix}"


class Run:
    def __init__(self) -> None:
        self.settings = GuardSettings(interval=5, policy="repair")
        self.schedule = Schedule()
        self.slots: list[Slot] = []
        self.keys: dict[int, list[str]] = {}
        self.last: dict[str, Any] = {}

    def exchange(self) -> list[Slot | None]:
        world = max(s.rank for s in self.slots) + 1
        words = [0] * (world * slot_words())
        for slot in self.slots:
            offset = slot.rank * slot_words()
            words[offset : offset + slot_words()] = encode(slot)
        self.slots = []
        return decode(words, world)

    def do(self, cmd: str, args: list[str]) -> None:
        kv, flags = _kv(args)
        if cmd == "config":
            self.settings = GuardSettings(int(kv["interval"]), kv["policy"])
            self.schedule = Schedule()
        elif cmd == "quorum":
            mine = f"me:{advertise(self.settings, 12345)}"
            assert advertised(mine) == (divergence.FORMAT, self.settings)
            peers = kv.get("peers", "same").split(",")
            ids = [mine] + [_peer(p, self.settings, 777 + i) for i, p in enumerate(peers)]
            self.last["due"] = self.schedule.due(
                quorum_id=int(kv["id"]),
                step=int(kv["step"]),
                heals="heals" in flags,
                settings=agreed(ids),
            )
        elif cmd == "slot":
            entries: tuple[tuple[int, int, int], ...] = ()
            keys: list[str] = []
            if "state" in kv:
                pairs = [p.split(":", 1) for p in kv["state"].split(",")]
                keys = [k for k, _ in pairs]
                entries = tuple((name_hash(k), name_hash(v), 3 * name_hash(v)) for k, v in pairs)
            rank = int(kv["rank"])
            self.keys[rank] = keys
            self.slots.append(
                Slot(
                    rank=rank,
                    interval=int(kv.get("interval", 5)),
                    policy=POLICIES.index(kv.get("policy", "repair")) + 1,
                    step=int(kv["step"]),
                    eligible="ineligible" not in flags,
                    last_heal=int(kv.get("last_heal", -1)),
                    entries=entries,
                )
            )
        elif cmd == "verdict":
            self.last["awaited"] = verdict_awaited(
                then_quorum_id=int(kv["then"]), now_quorum_id=int(kv["now"]), ended="ended" in flags
            )
        elif cmd == "judge":
            self.last["verdict"] = judge(self.exchange(), int(kv["step"]))
        elif cmd == "expect":
            self.expect(args)
        else:
            raise ValueError(f"unknown command {cmd!r}")

    def expect(self, args: list[str]) -> None:
        what, rest = args[0], args[1:]
        kv, flags = _kv(rest)
        if what == "due":
            want = None if rest[0] == "-" else rest[0]
            assert self.last["due"] == want, f"due {self.last['due']!r}, expected {want!r}"
        elif what == "verdict":
            v = self.last["verdict"]
            if "matched" in flags:
                assert v.matched, v
            else:
                assert not v.matched, v
            if "compared" in kv:
                assert v.compared == _ranks(kv["compared"]), v
            if "reference" in kv:
                assert v.reference == _ranks(kv["reference"]), v
            if "repair" in kv:
                assert v.repair == _ranks(kv["repair"]), v
            if "rule" in kv:
                assert v.rule == kv["rule"], v.rule
        elif what == "awaited":
            assert self.last["awaited"] == (rest[0] == "yes"), self.last["awaited"]
        elif what == "differing":
            rank, keys = rest[0].split(":", 1)
            names = self.keys[int(rank)]
            got = [names[i] for i in self.last["verdict"].differing[int(rank)]]
            assert got == keys.split(","), got
        else:
            raise ValueError(f"unknown expectation {what!r}")


@pytest.mark.parametrize("script", sorted(SCENARIOS.glob("*.txt")), ids=lambda p: p.stem)
def test_scenario(script: Path) -> None:
    run = Run()
    for number, line in enumerate(script.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        cmd, *args = shlex.split(line)
        try:
            run.do(cmd, args)
        except AssertionError as e:
            raise AssertionError(f"{script.name}:{number}: {line}: {e}") from None


def test_the_second_exchange_names_the_tensors_that_differ() -> None:
    # After a mismatch every member writes its tensors' digests in its region; the regions of
    # the members outside the reference are compared with the reference's first member.
    slots = [
        Slot(rank=0, interval=5, policy=1, step=3, eligible=True, last_heal=-1, tensors=3),
        Slot(rank=1, interval=5, policy=1, step=3, eligible=True, last_heal=-1, tensors=3),
        Slot(rank=2, interval=5, policy=1, step=3, eligible=False, last_heal=-1, tensors=0),
    ]
    count = tensor_count([*slots, None])
    assert count == 3
    regions = [
        tensor_words([(1, 2), (3, 4), (5, 6)], count),
        tensor_words([(1, 2), (3, 5), (5, 6)], count),  # its second tensor differs
        tensor_words([], count),  # not compared: zeros
    ]
    words = [w for region in regions for w in region]
    verdict = Verdict(step=3, compared=(0, 1), reference=(0,), repair=(1,))
    assert differing_tensors(words, count, verdict) == {1: (1,)}
    # A member with fewer tensors (a skipped optimizer state) differs where it has none.
    short = tensor_words([(1, 2)], count)
    assert differing_tensors(regions[0] + short, count, verdict) == {1: (1, 2)}
