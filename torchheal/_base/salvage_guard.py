"""The guard of wrappers that read reduced tensors before the vote, so cannot be salvaged."""

from __future__ import annotations

from typing import Any

__all__ = ["refuse_salvage"]


def refuse_salvage(manager: Any, who: str) -> None:
    """Raises when ``manager`` salvages steps: ``who`` reads the reduced values before the vote.

    A salvaged step redoes its allreduces after the failed attempt, into the same tensors; a
    reader that copied them earlier keeps the failed attempt's values.
    """
    if getattr(manager, "salvage_step", False) is True:
        raise ValueError(
            f"{who} reads its reduced tensors before should_commit, which a salvaged step "
            "would redo afterwards: build the Manager with salvage_step=False (unset "
            "TORCHHEAL_SALVAGE_STEP)"
        )
