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

import warnings
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

import torch

from torchheal._base.timeouts import to_seconds
from torchheal.checkpointing.rwlock import RWLock
from torchheal.checkpointing.transport import CheckpointTransport
from torchheal.manager.log import ManagerLogger
from torchheal.manager.machine import StepMachine

T = TypeVar("T")

__all__ = ["ManagerUserState", "StateRegistry", "copy_tensors"]


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
        #: State compared by the divergence guard but never sent to a healer.
        self.fingerprinted: dict[str, Callable[[], Any]] = {}
        #: The registered keys the divergence guard compares (None: all of them).
        self.compared_keys: frozenset[str] | None = None

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

    def read_compared(self, counters: Callable[[], Mapping[str, int]]) -> dict[str, Any]:
        """:meth:`read`, keeping only the keys the divergence guard compares."""
        state = self.read(counters)
        if self.compared_keys is not None:
            state["user"] = {k: v for k, v in state["user"].items() if k in self.compared_keys}
        return state

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


class ManagerUserState:
    """The Manager's methods for the user's state and its own counters (part of ``Manager``,
    whose ``report_error`` they use)."""

    _state: StateRegistry
    _machine: StepMachine
    _checkpoint_transport: CheckpointTransport[Any]
    _logger: ManagerLogger
    _telemetry: Any

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Registers a named pair of user state functions sent to healing peers.

        Args:
            key: unique name; the receiver loads ``state["user"][key]`` with its function.
            load_state_dict: loads the received state (called on the training thread).
            state_dict: returns the state to send (called on the training thread).

        Raises:
            AssertionError: ``key`` is already registered.
        """
        self._state.register(key, load_state_dict, state_dict)

    def register_fingerprint(self, key: str, state_dict: Callable[[], Any]) -> None:
        """Adds state the divergence guard compares across groups but a heal does not send
        (a scheduler or a data position the user restores some other way): a group whose
        copy differs is reported (``docs/divergence.md``).

        Args:
            key: unique name among these.
            state_dict: returns the state (called on the training thread).

        Raises:
            AssertionError: ``key`` is already registered.
        """
        if key in self._state.fingerprinted:
            raise AssertionError(f"fingerprint fn {key!r} already registered")
        self._state.fingerprinted[key] = state_dict

    def divergence_checks(self) -> tuple[int, int]:
        """``(comparisons, mismatches)``: what the divergence guard found on this rank so far."""
        stats = self._telemetry.stats
        return stats.divergence_checks, stats.divergence_mismatches

    def compare_only(self, keys: Iterable[str]) -> None:
        """Makes the divergence guard compare only these keys of the registered state.

        For state that differs between groups by design between their syncs: LocalSGD's and
        DiLoCo's local models and inner optimizers (DiLoCo compares its fragments' global
        state, which every group holds the same after a sync).

        Args:
            keys: keys given to :meth:`register_state_dict_fn`.
        """
        self._state.compared_keys = frozenset(keys)

    def set_state_dict_fns(
        self, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Deprecated: use :meth:`register_state_dict_fn`.

        Args:
            load_state_dict: see ``register_state_dict_fn``.
            state_dict: see ``register_state_dict_fn``.
        """
        warnings.warn(
            "Manager.set_state_dict_fns is deprecated; use register_state_dict_fn",
            DeprecationWarning,
            stacklevel=2,
        )
        self.register_state_dict_fn("set_state_dict_fns", load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        """Lets peers read the state dict again after :meth:`disallow_state_dict_read`."""
        self._state.unblock_reads()

    def disallow_state_dict_read(self) -> None:
        """Makes state-dict reads wait while the state is being changed (idempotent)."""
        self._state.block_reads()
        if self._checkpoint_transport.copies_on_write is True:
            # A transport serving the state where it lies copies what a healer still needs now.
            self._checkpoint_transport.disallow_checkpoint()

    def _manager_state_dict(self) -> dict[str, Any]:
        return self._state.read(self.state_dict)

    def _capture_state_dict(self) -> dict[str, Any] | None:
        if self._state.empty:
            return None
        if not self._state.reads_allowed:
            # This thread holds the writer side; reading would wait for ourselves.
            self._logger.warning(
                "state-dict reads are disallowed at start_quorum; cannot serve recovery this step"
            )
            return None
        try:
            return self._manager_state_dict()
        except Exception as e:
            self._logger.exception(f"capturing the state dict failed: {e}")
            self.report_error(e)
            return None

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restores the step and batch counters (from a checkpoint or a healing peer).

        Args:
            state_dict: ``{"step": int, "batches_committed": int}``.
        """
        self._machine.step = state_dict["step"]
        self._machine.batches_committed = state_dict["batches_committed"]

    def state_dict(self) -> dict[str, int]:
        """Returns ``{"step", "batches_committed"}``; checkpoint it with the user state."""
        return {"step": self._machine.step, "batches_committed": self._machine.batches_committed}
