"""The manager server's quorum round, driven by short scripts (STYLE.md §6).

Each scenario is a few lines; ``=>`` separates a command from what it must produce.

``world N``                                   a replica group of N ranks (first line).
``t=1.5 join R step=S remaining=X [shrink]``  rank R asks at time 1.5, waiting X seconds.
    ``=> wait r0``                            it now waits on round 0, which has not started;
    ``=> start r0 by step=S timeout=X [shrink]`` it completed round 0; the group's request.
``leave R r0``                                rank R gave up on round 0 (its latest request).
    ``=> left`` / ``=> stays``                whether the request was taken out.
``waiting 0,1`` / ``waiting -``               the ranks counted in the open round.
``check R step=S failures=F => ok|error "text"``
``retries N``                                 the retry policy for the following lines.
``fail attempt=A timeout=X status|silent [deadline] "error" => retry 1.5|give up [deadline] "text"``
"""

from __future__ import annotations

import re
import shlex

import pytest

from torchheal.coordination.round import GiveUp, QuorumRound, Retry, RetryPolicy
from torchheal.coordination.types import QuorumMember

SCENARIOS = {
    "last rank speaks for the group": """
        world 2
        t=0 join 0 step=3 remaining=10      => wait r0
        t=1 join 1 step=3 remaining=6 shrink => start r0 by step=3 timeout=6 shrink
        waiting -
        t=2 join 1 step=4 remaining=10      => wait r1
    """,
    "the group is at its lowest rank's step": """
        world 3
        # rank 1 healed to step 9, ranks 0 and 2 failed to: the whole group heals again
        t=0 join 0 step=4 remaining=10      => wait r0
        t=0 join 2 step=4 remaining=10      => wait r0
        t=1 join 1 step=9 remaining=6       => start r0 by step=4 timeout=6
        t=2 join 1 step=9 remaining=10      => wait r1
        t=2 join 2 step=4 remaining=10      => wait r1
        t=2 join 0 step=9 remaining=10      => start r1 by step=4 timeout=10
    """,
    "a rank asking again replaces its request": """
        world 2
        t=0 join 0 step=3 remaining=10      => wait r0
        t=1 join 0 step=3 remaining=10 shrink => wait r0
        waiting 0
        t=2 join 1 step=3 remaining=10      => start r0 by step=3 timeout=10
    """,
    "an expired request no longer completes a round": """
        world 2
        t=0 join 0 step=1 remaining=1       => wait r0
        # rank 0's deadline (t=1) passed before rank 1 arrives: the round waits for its retry
        t=1 join 1 step=1 remaining=5       => wait r0
        waiting 1
        t=2 join 0 step=1 remaining=5       => start r0 by step=1 timeout=5
    """,
    "a rank that gave up leaves only an unstarted round": """
        world 3
        t=0 join 0 step=0 remaining=5       => wait r0
        t=0 join 1 step=0 remaining=5       => wait r0
        leave 0 r0                          => left
        waiting 1
        leave 0 r0                          => stays
        t=1 join 0 step=0 remaining=5       => wait r0
        t=1 join 2 step=0 remaining=5       => start r0 by step=0 timeout=5
        # round 0 started: giving up on it changes nothing in round 1
        leave 2 r0                          => stays
    """,
    "a group of one starts at once": """
        world 1
        t=0 join 0 step=7 remaining=2       => start r0 by step=7 timeout=2
        t=0 join 0 step=8 remaining=2       => start r1 by step=8 timeout=2
    """,
    "impossible requests are rejected": """
        world 2
        check 1 step=0 failures=0           => ok
        check 2 step=0 failures=0           => error "group_rank 2 is outside [0, 2)"
        check -1 step=0 failures=0          => error "outside"
        check 0 step=-1 failures=0          => error "step must be >= 0"
        check 0 step=0 failures=-2          => error "commit_failures must be >= 0"
    """,
    "retries spread over the round's time, then give up": """
        retries 2
        fail attempt=0 timeout=6 status "status: Unavailable"   => retry 2
        fail attempt=1 timeout=6 silent deadline "no answer"    => retry 0.1
        fail attempt=2 timeout=6 status deadline "status: DeadlineExceeded" => give up deadline "failed after 2 retries. last error: status: DeadlineExceeded"
        # a short round still pauses at least 100 ms
        fail attempt=0 timeout=0.15 status "x"                 => retry 0.1
    """,
    "no retries: the first failure is final": """
        retries 0
        fail attempt=0 timeout=5 status "status: Internal" => give up "failed after 0 retries. last error: status: Internal"
    """,
}


def _kv(words: list[str]) -> dict[str, str]:
    return dict(w.split("=", 1) for w in words if "=" in w)


def _run(script: str) -> None:
    round_: QuorumRound | None = None
    policy: RetryPolicy | None = None
    members: dict[int, QuorumMember] = {}
    for number, raw in enumerate(script.strip().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        command, _, expected = (part.strip() for part in line.partition("=>"))
        words = shlex.split(command)
        want = shlex.split(expected)
        where = f"line {number}: {line}"
        if words[0] == "world":
            round_ = QuorumRound(int(words[1]))
        elif words[0].startswith("t=") and words[1] == "join":
            assert round_ is not None
            now, rank, kv = float(words[0][2:]), int(words[2]), _kv(words[3:])
            member = QuorumMember("g", step=int(kv["step"]), shrink_only="shrink" in words)
            members[rank] = member
            joined = round_.join(rank, member, now, float(kv["remaining"]))
            if want[0] == "wait":
                assert joined.start is None and joined.round_id == int(want[1][1:]), where
            else:
                start, kv_want = joined.start, _kv(want)
                assert start is not None and start.round_id == int(want[1][1:]), where
                assert start.member.step == int(kv_want["step"]), where
                assert start.timeout_s == float(kv_want["timeout"]), where
                assert start.member.shrink_only == ("shrink" in want), where
        elif words[0] == "leave":
            assert round_ is not None
            rank = int(words[1])
            left = round_.leave(rank, int(words[2][1:]), members[rank])
            assert left == (want == ["left"]), where
        elif words[0] == "waiting":
            assert round_ is not None
            expect = set() if words[1] == "-" else {int(r) for r in words[1].split(",")}
            assert round_.waiting == expect, where
        elif words[0] == "check":
            assert round_ is not None
            kv = _kv(words[2:])
            args = (int(words[1]), int(kv["step"]), int(kv["failures"]))
            if want == ["ok"]:
                round_.check(*args)
            else:
                with pytest.raises(ValueError, match=re.escape(want[1])):
                    round_.check(*args)
        elif words[0] == "retries":
            policy = RetryPolicy(int(words[1]))
        elif words[0] == "fail":
            assert policy is not None
            kv = _kv(words[1:])
            decision = policy.after_failure(
                int(kv["attempt"]),
                float(kv["timeout"]),
                got_status="status" in words,
                timed_out="deadline" in words,
                error=words[-1],
            )
            if want[0] == "retry":
                assert decision == Retry(float(want[1])), f"{where}: got {decision}"
            else:
                assert isinstance(decision, GiveUp), f"{where}: got {decision}"
                assert decision.timed_out == ("deadline" in want), where
                assert want[-1] in decision.message, f"{where}: got {decision.message!r}"
        else:
            raise AssertionError(f"unknown command at {where}")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_scenario(name: str) -> None:
    _run(SCENARIOS[name])


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size"):
        QuorumRound(0)
