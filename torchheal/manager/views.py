"""Attributes of the reference's Manager that tests read and set, kept as views of the parts.

The reference's tests (and tools written against it) reach into a Manager's private fields:
``_healing``, ``_pending_state_dict``, ``_quorum_id``, ``_quorum_future``, ``_errored`` and
more (reference §2.2). Our Manager keeps that data in the parts that own it, so each such
name is a :class:`View`: reading or setting it reads or sets the field of the part, and there
is one copy of the truth.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torchheal.coordination.plan import Participation

__all__ = ["ParticipationField", "ReferenceViews", "View"]


class View:
    """A Manager attribute that is a field of one of its parts.

    Args:
        part: the Manager's attribute holding the part (``"_heal"``).
        field: the part's field (``"healing"``).
        writable: setting the attribute sets the field (else it is read-only).
    """

    def __init__(self, part: str, field: str, *, writable: bool = True) -> None:
        self._part = part
        self._field = field
        self._writable = writable

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self._part), self._field)

    def __set__(self, obj: Any, value: Any) -> None:
        if not self._writable:
            raise AttributeError(f"{self._name} is read-only")
        setattr(getattr(obj, self._part), self._field, value)


class ParticipationField:
    """``_participating_replica_rank`` / ``_world_size``: a field of the step machine's
    ``participation`` (a frozen value: setting one field replaces it).

    Args:
        field: ``"rank"`` or ``"count"``.
    """

    def __init__(self, field: str) -> None:
        self._field = field

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        current = obj._machine.participation
        if current is None:
            return None if self._field == "rank" else 0
        return getattr(current, self._field)

    def __set__(self, obj: Any, value: Any) -> None:
        machine = obj._machine
        current = machine.participation or Participation(None, 0)
        machine.participation = replace(current, **{self._field: value})


class ReferenceViews:
    """The reference's test-visible Manager attributes (§2.2), as views of the parts (part of
    ``Manager``)."""

    _errored = View("_ledger", "error")
    _healing = View("_machine", "healing")
    _pending_state_dict = View("_heal", "pending")
    _quorum_id = View("_connected", "quorum_id")
    _quorum_future = View("_quorums", "future")
    # Settable, as the reference's: a replacement guards reads and block/unblock from then on.
    _state_dict_lock = View("_state", "lock")
    _init_sync = View("_worker", "_init_sync")
    _is_state_dict_read_allowed = View("_state", "reads_allowed", writable=False)
    _step = View("_machine", "step")
    # The transport the heals use (a test may replace it after construction).
    _checkpoint_transport = View("_recovery", "transport")
    _batches_committed = View("_machine", "batches_committed")
    _commit_failures = View("_machine", "commit_failures")
    _participation = View("_machine", "participation")
    _participating_replica_rank = ParticipationField("rank")
    _participating_replica_world_size = ParticipationField("count")
