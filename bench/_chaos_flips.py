"""Bit flips in the chaos soak: what to flip, the order to a worker, and whether the guard said so.

``bench/chaos.py --flip-every S`` chooses, every S seconds, one rank of one group, one parameter
tensor, one element and one mantissa bit, from an rng of its own seeded by the soak's seed (the
sequence does not depend on timing), and writes it to that rank's order file
(``flip-g{group}r{rank}.json``, renamed into place so a worker never reads half of one). The
worker (``_chaos_worker.py``) applies it right after its next commit in a full quorum and emits
``flip``; the divergence guard (every step, ``repair``) makes every rank that sees a mismatch
emit ``divergence``. :func:`match` (pure) pairs them and says what is wrong.

Only mantissa bits (0-22 of a float32) are flipped: an exponent bit can make an element inf or
NaN, which the next averaged gradient carries to every group. The guard compares bits, so it
would catch that too, but every group's training would be poisoned alike.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._chaos_worker import HIDDEN, IN, OUT

#: The worker's parameters and their element counts (its ``nn.Sequential`` MLP).
PARAMETERS: dict[str, int] = {
    "0.weight": HIDDEN * IN,
    "0.bias": HIDDEN,
    "2.weight": OUT * HIDDEN,
    "2.bias": OUT,
}
MANTISSA_BITS = 23
#: The compared key a worker's model is fingerprinted under (``{"model": ..., "optim": ...}``).
KEY = "default/model"


@dataclass
class Flip:
    """One flipped bit and what became of it.

    Args:
        id: its number, from 1.
        group, rank, tensor, element, bit: what is flipped.
        ordered: when the order was written (wall clock).
        applied: when the worker flipped it (None: never).
        step: the worker's step when it flipped (its state after committing ``step - 1``): the
            first step the guard can compare it at.
        reported: when the flipped rank's guard first reported a mismatch after it.
        compared: the step that report compared.
        named: the report names the flipped tensor.
        missed: a comparison after the flip found the rank's state equal (the guard missed it).
    """

    id: int
    group: int
    rank: int
    tensor: str
    element: int
    bit: int
    ordered: float
    applied: float | None = None
    step: int | None = None
    reported: float | None = None
    compared: int | None = None
    named: bool = False
    missed: bool = False

    def what(self) -> str:
        return f"g{self.group} r{self.rank} {self.tensor}[{self.element}] bit {self.bit}"


def flip_rng(seed: int) -> random.Random:
    """The flips' own rng: the faults' draws and their timing do not change what is flipped."""
    return random.Random(f"flips-{seed}")


class FlipOrders:
    """The soak's side of the flips while it runs: orders them, and knows which one awaits its
    report (the soak injects nothing else meanwhile).

    Args:
        seed: the soak's seed (the flips' own rng, :func:`flip_rng`).
        workdir: where the order files go.
        groups, ranks: the job's shape.
        report_s: how long a flip may stay unreported before it stops being pending (the final
            check, :func:`match`, then counts it missed).
    """

    def __init__(self, seed: int, workdir: Path, groups: int, ranks: int, report_s: float) -> None:
        self.flips: list[Flip] = []
        self.pending: Flip | None = None
        self._rng = flip_rng(seed)
        self._workdir, self._groups, self._ranks = workdir, groups, ranks
        self._report_s = report_s
        self._until = 0.0

    def order_next(self, now: float, monotonic: float) -> Flip:
        """Chooses and orders the next flip; it is pending until reported."""
        flip = choose(self._rng, len(self.flips) + 1, self._groups, self._ranks, now)
        order(self._workdir, flip)
        self.flips.append(flip)
        self.pending, self._until = flip, monotonic + self._report_s
        return flip

    def track(self, event: dict[str, Any]) -> None:
        """The pending flip is done once its rank reports a mismatch after applying it."""
        f = self.pending
        if f is None or (event["group"], event["rank"]) != (f.group, f.rank):
            return
        if event["kind"] == "flip" and event["id"] == f.id:
            f.applied = event["time"]
        elif event["kind"] == "divergence" and f.applied is not None:
            self.pending = None

    def expire(self, monotonic: float) -> None:
        if self.pending is not None and monotonic > self._until:
            self.pending = None  # unreported: the final check says so


def choose(rng: random.Random, number: int, groups: int, ranks: int, now: float) -> Flip:
    """The next flip (any group, any rank, any parameter element, a mantissa bit)."""
    tensor = rng.choice(sorted(PARAMETERS))
    return Flip(
        id=number,
        group=rng.randrange(groups),
        rank=rng.randrange(ranks),
        tensor=tensor,
        element=rng.randrange(PARAMETERS[tensor]),
        bit=rng.randrange(MANTISSA_BITS),
        ordered=now,
    )


def order_path(workdir: Path, group: int, rank: int) -> Path:
    return workdir / f"flip-g{group}r{rank}.json"


def order(workdir: Path, flip: Flip) -> None:
    """Writes the flip's order for its rank, whole (a rename)."""
    path = order_path(workdir, flip.group, flip.rank)
    tmp = path.with_suffix(".tmp")
    order = {"id": flip.id, "tensor": flip.tensor, "element": flip.element, "bit": flip.bit}
    tmp.write_text(json.dumps(order))
    tmp.replace(path)


def match(flips: list[Flip], events: list[dict[str, Any]]) -> list[str]:
    """Fills each flip's outcome from the ranks' events; returns the problems.

    A flip's report is the first ``divergence`` its rank (any start of it) emitted after
    applying it. "Within one comparison": no ``step`` event of that rank between the flip and
    the report shows a comparison at or after the flip's step that matched.
    """
    problems = []
    ordered = sorted(events, key=lambda e: e["time"])
    for f in flips:
        mine = [e for e in ordered if (e["group"], e["rank"]) == (f.group, f.rank)]
        done = next((e for e in mine if e["kind"] == "flip" and e["id"] == f.id), None)
        if done is None:
            problems.append(f"flip {f.id} ({f.what()}) was never applied")
            continue
        f.applied, f.step = done["time"], done["step"]
        after = [e for e in mine if e["time"] > f.applied and e["inc"] == done["inc"]]
        report = next((e for e in after if e["kind"] == "divergence"), None)
        until = report["time"] if report is not None else float("inf")
        f.missed = any(
            e["kind"] == "step" and e["time"] <= until and e["guard"]["verified"] >= f.step
            for e in after
        )
        if report is not None:
            f.reported, f.compared = report["time"], report["step"]
            f.named = f"{KEY}/{f.tensor}" in report["message"]
        if report is None:
            problems.append(f"flip {f.id} ({f.what()}, at step {f.step}) was not reported")
        elif f.missed:
            problems.append(f"flip {f.id} ({f.what()}): a comparison after it matched")
        elif not f.named:
            problems.append(f"flip {f.id} ({f.what()}): the report does not name the tensor")
    return problems


def unexplained(flips: list[Flip], events: list[dict[str, Any]]) -> list[str]:
    """Mismatch reports no flip explains (a real divergence: the soak's own finding).

    A flip explains any rank's report of a compared step from the flip's step until the first
    step its rank's guard then found equal (the repair's): every member of a comparison reports
    it, and a group waiting to heal is compared once more. Steps, not times: a group stopped
    right after the comparison reports it when it wakes.
    """
    windows = []
    for f in flips:
        if f.applied is None or f.step is None:
            continue
        verified = [
            e["guard"]["verified"]
            for e in events
            if e["kind"] == "step"
            and (e["group"], e["rank"]) == (f.group, f.rank)
            and e["time"] > f.applied
            and e["guard"]["verified"] >= f.step
        ]
        windows.append((f.step, min(verified, default=float("inf"))))
    return [
        f"a mismatch no flip explains: g{e['group']} r{e['rank']}: {e['message'][:300]}"
        for e in events
        if e["kind"] == "divergence" and not any(a <= e["step"] < b for a, b in windows)
    ]


def flip_rows(flips: list[Flip], t0: float) -> list[tuple[str, ...]]:
    """The flip table: per flip, when, what, at which step, reported when and at which step."""

    def rel(t: float | None) -> str:
        return "-" if t is None else f"{t - t0:.1f}"

    rows = [("flip", "at s", "what", "step", "reported s", "compared step", "names tensor")]
    for f in flips:
        rows.append(
            (
                str(f.id),
                rel(f.applied if f.applied is not None else f.ordered),
                f.what(),
                "-" if f.step is None else str(f.step),
                rel(f.reported),
                "-" if f.compared is None else str(f.compared),
                "yes" if f.named else "no",
            )
        )
    return rows
