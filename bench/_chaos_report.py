"""The chaos soak's report as text: the fault table, the flip table, the end's verdicts."""

from __future__ import annotations

from bench._chaos_check import summary_rows
from bench._chaos_config import ChaosResult
from bench._chaos_flips import flip_rows


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def table(result: ChaosResult) -> str:
    """The fault table, the flip table (if any), the end's verdicts and the problems, as text."""
    head = ("fault", "injected", "survived", "job stall s (med/max)", "back s (med/max)", "lost")
    lines = _columns([head, *summary_rows(result.faults)])
    if result.flips:
        lines += ["", *_columns(flip_rows(result.flips, result.started))]
        reported = sum(f.reported is not None and not f.missed for f in result.flips)
        lines.append(f"flips reported within one comparison: {reported} of {len(result.flips)}")
    identical = {True: "yes", False: "NO", None: "not compared"}[result.identical]
    lines.append(f"every group bit-identical at the end: {identical}")
    lines.append(f"committed steps: {result.steps}; problems: {len(result.problems)}")
    lines += [f"  PROBLEM: {p}" for p in result.problems]
    return "\n".join(lines)
