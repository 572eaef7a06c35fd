"""The status document as one terminal screen, for ``torchheal status`` (pure)."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["render"]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{int(seconds // 60)} m {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} m"


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2f}" if rate < 10 else f"{rate:.1f}"


def _clock(t: float | None) -> str:
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def _after(t0: float | None, t1: float | None) -> str:
    return "-" if t0 is None or t1 is None else "+" + _duration(max(0.0, t1 - t0))


def _short(replica_id: str, group: str) -> str:
    rest = replica_id[len(group) + 1 :] if replica_id.startswith(group + ":") else replica_id
    return rest[:8]


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _clip(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


def _guard_lines(doc: dict[str, Any]) -> list[str]:
    # .get: a lighthouse older than the guard report sends none.
    groups = doc.get("guard") or {}
    if not groups:
        return []
    last_mark = {}
    for mark in reversed(doc.get("divergences") or []):  # newest last: it wins
        last_mark[mark["group"]] = mark
    rows = []
    for group, report in groups.items():
        verified = report["verified"]
        row = [
            group,
            f"verified step {verified}" if verified >= 0 else "not verified yet",
            f"{report['checks']} comparisons",
        ]
        n = report["mismatches"]
        if n:
            mark = last_mark.get(group)
            where = f", last at step {mark['step']} ({_clock(mark['t'])})" if mark else ""
            row.append(f"{n} mismatch{'es' if n > 1 else ''}{where}")
        rows.append(row + [""] * (4 - len(row)))
    return ["", "divergence guard:"] + ["  " + line for line in _table(rows, right={2})]


def render(doc: dict[str, Any], width: int = 120, failures: int = 5, changes: int = 5) -> str:
    """One screen of text describing the job from ``GET /api/status``'s document, lines cut at
    ``width``, listing the latest ``failures`` failures and ``changes`` quorum changes."""
    q = doc["quorum"]
    job = doc["job"]
    config = doc["config"]
    not_healed = sum(1 for f in doc["failures"] if f["state"] != "healed")
    lines = [
        f"torchheal lighthouse {doc['address']}  ·  quorum #{q['id']} (age {_duration(q['age_s'])})"
        f"  ·  job step {job['step'] if job['step'] is not None else '-'}"
        f"  ·  {_rate(job['rate'])} steps/s",
        f"members {q['size']} (min {config['min_replicas']})  ·  heartbeating "
        f"{doc['heartbeating']}  ·  failures {len(doc['failures'])} ({not_healed} not healed)",
        f"next quorum: {doc.get('next_quorum', doc['reason'])}",
        "",
    ]
    if q["members"]:
        rows = [
            [
                "GROUP",
                "REPLICA",
                "STATE",
                "STEP",
                "BEHIND",
                "STEPS/S",
                "HEARTBEAT",
                "FAILED",
                "MANAGER",
            ]
        ]
        timeout_s = config["heartbeat_timeout_ms"] / 1000.0
        for m in q["members"]:
            age = m["heartbeat_age_s"]
            silent = age is None or age >= timeout_s
            state = "silent" if silent else "healing" if m["healing"] else "training"
            rows.append(
                [
                    m["group"],
                    _short(m["replica_id"], m["group"]),
                    state,
                    str(m["step"]),
                    str(m["behind"]),
                    _rate(m["rate"]),
                    _duration(age),
                    str(m["commit_failures"]),
                    m["address"],
                ]
            )
        lines += _table(rows, right={3, 4, 5, 6, 7})
    else:
        lines.append("no quorum yet")
    lines += _guard_lines(doc)
    if doc["outside"]:
        lines += ["", "outside the quorum:"]
        rows = [
            [
                o["group"],
                _short(o["replica_id"], o["group"]),
                o["state"],
                _duration(o["heartbeat_age_s"]),
            ]
            for o in doc["outside"]
        ]
        lines += ["  " + line for line in _table(rows, right={3})]
    if doc["failures"]:
        lines += ["", "last failures:"]
        rows = [
            [
                _clock(f["noticed"]),
                f["group"],
                f["cause"],
                f["state"],
                "went on " + _after(f["noticed"], f["went_on"]),
                "healed " + _after(f["noticed"], f["healed"]),
                "lost " + _duration(f["lost_s"]),
                "down " + _duration(f["down_s"]),
            ]
            for f in doc["failures"][:failures]
        ]
        lines += ["  " + line for line in _table(rows, right=set())]
    if doc["changes"]:
        lines += ["", "last quorum changes:"]
        for c in doc["changes"][:changes]:
            parts = [f"+{j['group']} ({j['why']})" for j in c["joined"]]
            parts += [f"-{left['group']} ({left['why']})" for left in c["left"]]
            parts += [
                f"{f['replica_id']}: {f['commit_failures']} failed commits"
                for f in c["commit_failures"]
            ]
            lines.append(
                f"  {_clock(c['t'])}  #{c['quorum_id']}  size {c['size']}  " + "; ".join(parts)
            )
    return "\n".join(_clip(line, width) for line in lines)
