"""An optimizer wrapper that ties the optimizer's step to the Manager's step lifecycle.

``zero_grad`` starts the step (``manager.start_quorum``) and ``step`` only applies the update
when the replica group voted to commit (``manager.should_commit``), so the canonical loop
``zero_grad -> forward -> backward -> step`` is fault tolerant without other changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer


class OptimizerWrapper(Optimizer):
    """Wraps ``optim`` so its steps follow the Manager's quorum and commit vote.

    Args:
        manager: the Manager of this rank.
        optim: the optimizer to wrap.
    """

    # Deliberately no super().__init__: all optimizer state stays in the wrapped optimizer.
    def __init__(self, manager: Any, optim: Optimizer) -> None:
        self.optim = optim
        self.manager = manager

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a parameter group to the wrapped optimizer."""
        self.optim.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the wrapped optimizer's state."""
        self.optim.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        """Returns the wrapped optimizer's state."""
        return self.optim.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Starts the step's quorum, then zeroes the gradients."""
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Steps the wrapped optimizer if the replica group commits (``closure`` must be None)."""
        assert closure is None, "optimizers that use closures are not supported"
        if self.manager.should_commit():
            self.optim.step()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's parameter groups."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, param_groups: list[dict[str, Any]]) -> None:
        self.optim.param_groups = param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter state."""
        return self.optim.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optim.state = state
