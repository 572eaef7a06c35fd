"""Accelerator-generic stream helpers (public path ``torchheal.utils``, as the reference's).

The one place that knows whether the accelerator is CUDA or an Intel XPU; no-ops on CPU.
"""

from __future__ import annotations

import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

__all__ = [
    "dtensor_type",
    "extract_trailing_digits",
    "get_stream_context",
    "quorum_global_ranks",
    "record_event",
    "synchronize",
]


def _xpu_available() -> bool:
    xpu = getattr(torch, "xpu", None)
    return xpu is not None and xpu.is_available()


def get_stream_context(stream: Any | None) -> AbstractContextManager[Any]:
    """A context manager that makes ``stream`` current (a no-op for ``None`` or on CPU)."""
    if stream is None:
        return nullcontext()
    if torch.cuda.is_available():
        return torch.cuda.stream(stream)
    if _xpu_available():
        return torch.xpu.stream(stream)
    return nullcontext()


def record_event() -> Any:
    """Records an event on the current accelerator stream (interprocess on CUDA) and returns it."""
    if _xpu_available():
        event = torch.xpu.Event()
        torch.xpu.current_stream().record_event(event)
        return event
    if not torch.cuda.is_available():
        raise RuntimeError("record_event needs a CUDA or XPU device; none is available")
    event = torch.cuda.Event(interprocess=True)
    torch.cuda.current_stream().record_event(event)
    return event


def synchronize() -> None:
    """Waits for the current accelerator stream (a no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
    elif _xpu_available():
        torch.xpu.current_stream().synchronize()


def extract_trailing_digits(s: str) -> int:
    """The number at the end of ``s`` (``"torchtitan_ft_12"`` -> 12), 0 when there is none."""
    digits = len(s) - len(s.rstrip("0123456789"))
    return int(s[-digits:]) if digits else 0


def quorum_global_ranks(
    replica_ids: list[str], group_rank: int, group_world_size: int
) -> list[int] | None:
    """Global rank of this group rank in each replica of a quorum, in replica-rank order.

    A replica id's number (before the Manager's ``:uuid`` suffix) is its group index ``i``: global
    rank ``i * group_world_size + group_rank``. None when the numbers are not distinct.
    """
    indices = [extract_trailing_digits(rid.split(":", 1)[0]) for rid in replica_ids]
    if not indices or len(set(indices)) != len(indices):
        return None
    return [i * group_world_size + group_rank for i in indices]


def dtensor_type() -> type | None:
    """Returns the DTensor class, or None while nothing in this process has imported it.

    Importing it is slow (sympy), and no object is a DTensor before its module is imported.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None
