"""The JSON status the dashboard serves: the lighthouse's snapshot joined with its history (pure).

``LighthouseServer.status()`` is the authority on the present; the history adds what only a
memory of the past can say. The document's shape is described in ``docs/dashboard.md``.
"""

from __future__ import annotations

from typing import Any

from torchheal.coordination.lighthouse.dashboard.events import group_name

__all__ = ["STATUS_VERSION", "build_status", "next_quorum"]

#: Bumped when a field of the status document changes meaning or disappears.
STATUS_VERSION = 1


def next_quorum(
    reason: str, quorum_id: int, size: int, age_s: float | None, asking: int, timeout_s: float
) -> str:
    """What the next quorum waits for, in words that are true between rounds.

    Between a healthy job's rounds nobody asks, so the reason reads "New quorum not ready" while
    every group trains: say that instead. Long after the last quorum (older than ``timeout_s``)
    or before any, the reason explains a stall and is shown as it is.
    """
    recent = age_s is not None and age_s < timeout_s and size > 0
    if not reason.startswith("New quorum not ready") or not recent:
        return reason
    if asking == 0:
        return f"between rounds: the {size} groups of quorum #{quorum_id} are training"
    return (
        f"round starting: {asking} of the {size} groups of quorum #{quorum_id} asked for the "
        f"next quorum ({reason})"
    )


def build_status(
    lighthouse: dict[str, Any],
    history: dict[str, Any],
    now: float,
    *,
    address: str = "",
    token_required: bool = False,
    missing_assets: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Join ``LighthouseServer.status()`` and ``History.view(now)`` into the status document."""
    config = lighthouse["config"]
    timeout_s = config["heartbeat_timeout_ms"] / 1000.0
    ages: dict[str, float] = lighthouse["heartbeats"]
    prev = lighthouse["prev_quorum"]
    members_now = prev["participants"] if prev else []
    max_step = prev["max_step"] if prev else None
    rates = {m["group"]: m["rate"] for m in history["members"]}
    in_quorum = {m["replica_id"] for m in members_now}
    guard = history["guard"]

    members = []
    for m in members_now:
        rid = m["replica_id"]
        age = ages.get(rid)
        group = group_name(rid)
        # The group's last guard report, if this start of it sent one.
        report = guard.get(group)
        if report is not None and report["replica_id"] != rid:
            report = None
        members.append(
            {
                "replica_id": rid,
                "group": group,
                "step": m["step"],
                "behind": (max_step - m["step"]) if max_step is not None else 0,
                "healing": max_step is not None and m["step"] < max_step,
                "rate": rates.get(group),
                "heartbeat_age_s": age,
                "alive": age is not None and age < timeout_s,
                "commit_failures": m["commit_failures"],
                "world_size": m["world_size"],
                "address": m["address"],
                "store_address": m["store_address"],
                "verified": report["verified"] if report else None,
                "mismatches": report["mismatches"] if report else None,
            }
        )

    # Everyone the lighthouse knows of outside the quorum: waiting to join, heartbeating without
    # asking (stragglers), or silent past the heartbeat timeout (lost).
    outside = []
    waiting = set(lighthouse["waiting"])
    for rid in sorted((waiting | ages.keys()) - in_quorum):
        age = ages.get(rid)
        if age is not None and age >= timeout_s:
            state = "lost"
        elif rid in waiting:
            state = "waiting"
        else:
            state = "idle"
        outside.append(
            {"replica_id": rid, "group": group_name(rid), "state": state, "heartbeat_age_s": age}
        )

    quorum_age = prev["age_s"] if prev else None
    return {
        "version": STATUS_VERSION,
        "now": now,
        "address": address,
        "token_required": token_required,
        "missing_assets": list(missing_assets),
        "config": config,
        "quorum": {
            "id": lighthouse["quorum_id"],
            "age_s": quorum_age,
            "size": len(members),
            "max_step": max_step,
            "members": members,
        },
        "reason": lighthouse["reason"],
        # The reason in words that are true between rounds (what the page and CLI show).
        "next_quorum": next_quorum(
            lighthouse["reason"],
            lighthouse["quorum_id"],
            len(members),
            quorum_age,
            len(lighthouse["waiting"]),
            timeout_s,
        ),
        # How long the lighthouse has been saying this (meaningful when it is stuck).
        "reason_since": (
            history["reason_since"] if history["reason"] == lighthouse["reason"] else None
        ),
        "outside": outside,
        "heartbeating": sum(1 for age in ages.values() if age < timeout_s),
        "job": {"step": max_step, "rate": history["job_rate"], "rounds": history["rounds"]},
        "changes": history["changes"],
        "failures": history["failures"],
        # Kept after a group left the quorum; divergences newest first.
        "guard": guard,
        "divergences": history["divergences"],
    }
