"""The user's state as the Manager sees it: named functions, and a lock that keeps reads whole.

A replica that heals receives ``{"user": {key: state}, "torchft": counters}``. The user
registers one ``(load_state_dict, state_dict)`` pair per key; :class:`StateRegistry` holds
them, reads every pair into one dict, copies what was read, and loads what was received.

Reading is guarded by a reader/writer lock: code that leaves the state inconsistent for a
while (an optimizer step in LocalSGD/DiLoCo) blocks reads with :meth:`StateRegistry.block_reads`
and lets them in again with :meth:`StateRegistry.unblock_reads`; a read then waits, and times
out instead of sending half an update.

Deliberate difference from the reference: the Manager calls :meth:`read` and :meth:`load` only
on the training thread; background threads only ever see copies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from torchheal._base.timeouts import to_seconds
from torchheal.checkpointing.rwlock import RWLock

__all__ = ["StateRegistry", "copy_tensors"]


class StateRegistry:
    """Named user state functions and the lock around reading them.

    Args:
        lock_timeout: how long a read (or blocking reads) may wait for the lock.
    """

    def __init__(self, lock_timeout: timedelta) -> None:
        self._loaders: dict[str, Callable[[Any], None]] = {}
        self._readers: dict[str, Callable[[], Any]] = {}
        self.lock = RWLock(timeout=to_seconds(lock_timeout))
        # True while the training thread holds the writer side (reads must wait).
        self._writer_held = False

    def register(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Adds a named pair of state functions.

        Args:
            key: unique name; a healing peer loads ``received["user"][key]`` with its loader.
            load_state_dict: loads received state.
            state_dict: returns the state to send.

        Raises:
            AssertionError: ``key`` is already registered (as the reference's tests expect).
        """
        if key in self._loaders or key in self._readers:
            raise AssertionError(f"state dict fn {key!r} already registered")
        self._loaders[key] = load_state_dict
        self._readers[key] = state_dict

    @property
    def empty(self) -> bool:
        """Whether no state function is registered."""
        return not self._readers

    @property
    def reads_allowed(self) -> bool:
        """False between :meth:`block_reads` and :meth:`unblock_reads`."""
        return not self._writer_held

    def block_reads(self) -> None:
        """Makes reads wait until :meth:`unblock_reads` (idempotent).

        Raises:
            TimeoutError: a read in progress did not finish within the lock timeout.
        """
        if self._writer_held:
            return
        self.lock.w_acquire()
        self._writer_held = True

    def unblock_reads(self) -> None:
        """Lets reads proceed again (idempotent)."""
        if not self._writer_held:
            return
        self._writer_held = False
        self.lock.w_release()

    def read(self, counters: Callable[[], Mapping[str, int]]) -> dict[str, Any]:
        """Reads every registered function, under the read lock.

        Args:
            counters: returns the Manager's own counters (the ``"torchft"`` section).

        Returns:
            ``{"user": {key: state}, "torchft": counters}`` holding references to live tensors.

        Raises:
            AssertionError: nothing is registered (the reference's message).
            TimeoutError: reads stayed blocked longer than the lock timeout.
        """
        with self.lock.r_lock():
            if self.empty:
                # Worded as the reference's; its tests match this text.
                raise AssertionError("user state_dict is not initialized.")
            user = {key: read_fn() for key, read_fn in self._readers.items()}
            return {"user": user, "torchft": dict(counters())}

    def copy(self, state: Any) -> Any:
        """A private copy of ``state``'s tensors, taken while reads are allowed.

        ``read`` returns references to live tensors; a transport may send them long after
        (a peer downloads at its own pace) while training goes on (Streaming DiLoCo steps
        during a sync). Copying under the read lock hands the peer one consistent state.

        Args:
            state: what :meth:`read` returned.
        """
        with self.lock.r_lock():
            return copy_tensors(state)

    def load(self, user: Mapping[str, Any]) -> None:
        """Hands each registered loader its part of a received ``"user"`` section.

        Args:
            user: the received ``"user"`` section.

        Raises:
            KeyError: the sender registered other keys than this replica.
        """
        for key, load_fn in self._loaders.items():
            load_fn(user[key])


def copy_tensors(tree: Any) -> Any:
    """``tree`` with each tensor replaced by a detached copy (containers rebuilt, rest shared).

    Args:
        tree: nested dicts, lists and tuples (named tuples are left whole).
    """
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return type(tree)((key, copy_tensors(value)) for key, value in tree.items())
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(copy_tensors(value) for value in tree)
    return tree
