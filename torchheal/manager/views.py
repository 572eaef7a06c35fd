"""Attributes of the reference's Manager that tests read and set, kept as views of the parts.

The reference's tests (and tools written against it) reach into a Manager's private fields:
``_healing``, ``_pending_state_dict``, ``_quorum_id``, ``_quorum_future``, ``_errored`` and
more (reference §2.2). Our Manager keeps that data in the parts that own it, so each such
name is a :class:`View`: reading or setting it reads or sets the field of the part, and there
is one copy of the truth.
"""

from __future__ import annotations

from typing import Any

__all__ = ["View"]


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
