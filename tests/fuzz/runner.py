"""Drive one endpoint with generated inputs and count how each was answered.

An endpoint is a :class:`Target`: a live server (or receiver) plus the hypothesis strategy of
its inputs, a way to send one input and classify the answer, a snapshot of the state a refused
input must not change, a liveness check and a normal request. :func:`fuzz` runs ``n`` inputs
(``derandomize=True``, no example database: the same inputs on every machine for the same
source; hypothesis mixes in constants from torchheal's modules) and returns a
:class:`Tally`. In ``strict`` mode (the test suite) the first bad outcome fails the hypothesis
run, which then shrinks it to a minimal input; otherwise (``bench/fuzz.py``) everything is
counted and the table shows it.

Outcomes:

* ``accepted``: a well-formed request, answered normally.
* ``rejected``: refused with a clear error (a gRPC status with a message naming the problem,
  an HTTP 4xx with a body, a ``CheckpointError``...).
* ``unclear``: an error that names nothing or comes from an unexpected exception (gRPC
  ``INTERNAL`` from a handler's catch-all, ``UNKNOWN``, HTTP 5xx, a dropped connection).
* ``state changed``: refused, but the server's state moved anyway.
* ``crash``: the server (thread or process) is gone or no longer answers a normal request.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

ACCEPTED = "accepted"
REJECTED = "rejected"
UNCLEAR = "unclear"
STATE_CHANGED = "state changed"
CRASH = "crash"
BAD = (UNCLEAR, STATE_CHANGED, CRASH)
# Bad inputs a tally keeps whole (some are megabytes).
MAX_BAD_VALUES = 20


@dataclass(frozen=True)
class Outcome:
    """How one input was answered.

    Args:
        kind: one of ``accepted``, ``rejected``, ``unclear``, ``crash``.
        detail: the status and message (or what went wrong), for reports.
        state_checked: a ``rejected`` outcome whose state must be unchanged (False for answers
            such as a deadline, where a request legitimately got part of the way).
    """

    kind: str
    detail: str = ""
    state_checked: bool = True


class Target(Protocol):
    """One endpoint under fuzzing (see the module docstring)."""

    name: str

    def inputs(self) -> st.SearchStrategy[Any]:
        """The strategy of this endpoint's inputs."""

    def send(self, value: Any) -> Outcome:
        """Send one input and classify the answer."""

    def snapshot(self) -> Any:
        """The state a rejected input must leave unchanged (compared with ``==``)."""

    def alive(self) -> str | None:
        """None while the server thread/process lives, else what happened to it."""

    def normal(self) -> str | None:
        """Make one normal request: None when it succeeded, else the error."""

    def known(self) -> list[Any]:
        """Known hostile inputs, each sent once before the generated ones (may be empty)."""


@dataclass
class Tally:
    """Counts of one endpoint's run, and the first few bad inputs.

    Args:
        name: the endpoint.
    """

    name: str
    counts: Counter[str] = field(default_factory=Counter)
    details: Counter[str] = field(default_factory=Counter)
    bad: list[str] = field(default_factory=list)
    # The first few bad inputs themselves, whole (``bench/fuzz.py --save-bad`` writes them).
    bad_values: list[Any] = field(default_factory=list)
    normal_after: str | None = "not run"
    seconds: float = 0.0

    @property
    def inputs(self) -> int:
        """Inputs sent."""
        return sum(self.counts.values())

    @property
    def ok(self) -> bool:
        """No bad outcome, and the normal request afterwards succeeded."""
        return not any(self.counts[k] for k in BAD) and self.normal_after is None

    def add(self, outcome: Outcome, value: Any) -> None:
        self.counts[outcome.kind] += 1
        self.details[f"{outcome.kind}: {_first_line(outcome.detail)}"] += 1
        if outcome.kind in BAD and len(self.bad) < 5:
            self.bad.append(f"{outcome.kind}: {outcome.detail[:300]} <- {_short(value)}")
        if outcome.kind in BAD and len(self.bad_values) < MAX_BAD_VALUES:
            self.bad_values.append((outcome, value))


def fuzz(
    target: Target,
    n: int,
    *,
    strict: bool = False,
    probe_every: int = 200,
    progress: Callable[[Tally], None] | None = None,
) -> Tally:
    """Send the target's known hostile inputs and ``n`` generated ones; then a normal request.

    Args:
        target: the endpoint.
        n: number of generated inputs (hypothesis ``max_examples``).
        strict: fail on the first bad outcome (and let hypothesis shrink it).
        probe_every: make a normal request after this many inputs, to catch a server that
            lives but no longer answers.
        progress: called after each probe with the tally so far.

    Returns:
        The tally; ``normal_after`` is None when the final normal request succeeded.
    """
    tally = Tally(target.name)
    start = time.monotonic()

    def check(value: Any) -> Outcome:
        before = target.snapshot()
        outcome = target.send(value)
        if outcome.kind == REJECTED and outcome.state_checked:
            after = target.snapshot()
            if before != after:  # (in this order: a snapshot may allow some changes over time)
                detail = f"{outcome.detail}; state {before!r} -> {after!r}"
                outcome = Outcome(STATE_CHANGED, detail)
        gone = target.alive()
        if gone is not None:
            outcome = Outcome(CRASH, f"{gone} (after: {outcome.kind} {outcome.detail})")
        elif tally.inputs and tally.inputs % probe_every == 0:
            error = target.normal()
            if error is not None:
                outcome = Outcome(CRASH, f"a normal request failed: {error}")
            if progress is not None:
                progress(tally)
        tally.add(outcome, value)
        if strict and outcome.kind in BAD:
            raise AssertionError(f"{target.name}: {outcome.kind}: {outcome.detail}")
        return outcome

    for value in target.known():
        try:
            check(value)
        except AssertionError as e:
            raise AssertionError(f"{e} <- {_short(value)}") from None

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate, Phase.shrink] if strict else [Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
    )
    @given(target.inputs())
    def one(value: Any) -> None:
        check(value)

    one()
    gone = target.alive()
    tally.normal_after = gone if gone is not None else target.normal()
    tally.seconds = time.monotonic() - start
    return tally


def assert_clean(tally: Tally, *, min_accepted: int = 1, min_rejected: int = 1) -> None:
    """The suite's verdict on a tally: nothing bad, both answers seen, a normal request after.

    Args:
        tally: the run.
        min_accepted: fewest accepted inputs (the inputs reached the server's logic).
        min_rejected: fewest rejected inputs.
    """
    assert tally.ok, f"{tally.name}: {dict(tally.counts)}; normal after: {tally.normal_after}; " + (
        "; ".join(tally.bad)
    )
    assert tally.counts[ACCEPTED] >= min_accepted, (tally.name, dict(tally.counts))
    assert tally.counts[REJECTED] >= min_rejected, (tally.name, dict(tally.counts))


def table(tallies: list[Tally]) -> str:
    """The fuzz table: one row per endpoint."""
    head = (
        "endpoint",
        "inputs",
        "rejected (clear error)",
        "accepted",
        "unclear",
        "state changed",
        "crashes",
        "normal request after",
        "seconds",
    )
    rows = [
        (
            t.name,
            str(t.inputs),
            str(t.counts[REJECTED]),
            str(t.counts[ACCEPTED]),
            str(t.counts[UNCLEAR]),
            str(t.counts[STATE_CHANGED]),
            str(t.counts[CRASH]),
            "ok" if t.normal_after is None else f"FAILED: {t.normal_after}"[:60],
            f"{t.seconds:.0f}",
        )
        for t in tallies
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "| " + " | ".join("-" * w for w in widths) + " |"
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |", line]
    out += [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows
    ]
    return "\n".join(out)


def _first_line(text: str) -> str:
    line = text.splitlines()[0] if text else ""
    return line[:120]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 300 else text[:300] + f"... ({len(text)} chars)"
