"""Live recovery, with the user's state touched only on the training thread.

:class:`_HealingMixin` is the part of the Manager that deals with state: the registry of named
user ``state_dict``/``load_state_dict`` functions, the state-dict read lock, the capture of what a
healing peer would receive (on the training thread, in ``start_quorum``), the transfer done by the
quorum thread (it only moves the captured tensors), and the load of received state (back on the
training thread). It is a mixin of :class:`torchheal.manager.Manager` and uses the attributes
declared below, which the Manager's constructor sets.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch

from torchheal.checkpointing import CheckpointTransport
from torchheal.checkpointing.rwlock import RWLock
from torchheal.coordination.client import ManagerClient
from torchheal.coordination.types import QuorumResult

T = TypeVar("T")


class _Logger(Protocol):
    def info(self, msg: str) -> None: ...

    def warning(self, msg: str) -> None: ...

    def exception(self, msg: str) -> None: ...


class _HealingMixin:
    """State capture, transfer and load for :class:`torchheal.manager.Manager`."""

    # Set by Manager.__init__.
    _load_state_dict_fns: dict[str, Callable[[Any], None]]
    _user_state_dicts: dict[str, Callable[[], Any]]
    _state_dict_lock: RWLock
    _is_state_dict_read_allowed: bool
    _checkpoint_transport: CheckpointTransport[Any]
    _recovery_stream: torch.cuda.Stream | None
    _recovery_event: torch.cuda.Event | None
    _pending_state_dict: dict[str, Any] | None
    _pre_heal_state: dict[str, int] | None
    _healing: bool
    _errored: Any
    _step: int
    _group_rank: int
    _timeout: timedelta
    _connect_timeout: timedelta
    _logger: _Logger

    # Provided by Manager.
    def report_error(self, e: Exception) -> None:
        raise NotImplementedError

    def wait_quorum(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, int]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        raise NotImplementedError

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Registers a named pair of user state functions sent to healing peers.

        Args:
            key: unique name; the receiver loads ``state["user"][key]`` with its function.
            load_state_dict: loads the received state (called on the training thread).
            state_dict: returns the state to send (called on the training thread).
        """
        assert key not in self._load_state_dict_fns, f"state dict fn {key!r} already registered"
        assert key not in self._user_state_dicts, f"state dict fn {key!r} already registered"
        self._load_state_dict_fns[key] = load_state_dict
        self._user_state_dicts[key] = state_dict

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

    def _capture_state_dict(self) -> dict[str, Any] | None:
        if not self._user_state_dicts:
            return None
        if not self._is_state_dict_read_allowed:
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

    def _recover(self, quorum: QuorumResult, captured: dict[str, Any] | None) -> None:
        stream = self._recovery_stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            try:
                if quorum.recover_dst_replica_ranks:
                    if captured is None:
                        raise RuntimeError(
                            "peers need recovery but no state was captured at start_quorum "
                            "(no state_dict function registered, or reads were disallowed)"
                        )
                    self._logger.info(
                        f"sending checkpoint of step {quorum.max_step} to replica ranks "
                        f"{list(quorum.recover_dst_replica_ranks)}"
                    )
                    self._checkpoint_transport.send_checkpoint(
                        dst_ranks=list(quorum.recover_dst_replica_ranks),
                        step=quorum.max_step,
                        state_dict=self._snapshot(captured),
                        timeout=self._timeout,
                    )
                if quorum.heal:
                    self._heal(quorum)
            except Exception as e:
                self._logger.exception(f"recovery failed: {e}")
                self.report_error(e)
            if stream is not None:
                self._recovery_event = stream.record_event()

    def _snapshot(self, captured: dict[str, Any]) -> dict[str, Any]:
        """A private copy of the captured tensors, taken while the optimizer cannot step.

        ``captured`` holds references to live tensors. A transport may read them long after
        this step's quorum (a peer downloads at its own pace), and training does not always
        wait: Streaming DiLoCo runs inner steps while a sync is in flight. Copying under the
        state-dict read lock gives the peer one consistent state; the cost is paid only on
        steps that send.
        """
        with self._state_dict_lock.r_lock():
            return _clone_tensors(captured)

    def _heal(self, quorum: QuorumResult) -> None:
        self._healing = True
        src_rank = quorum.recover_src_replica_rank
        if src_rank is None:
            raise RuntimeError("quorum says heal but names no source replica rank")
        self._logger.info(
            f"healing to step {quorum.max_step} from replica rank {src_rank} "
            f"({quorum.recover_src_manager_address})"
        )
        src_client = ManagerClient(
            quorum.recover_src_manager_address, connect_timeout=self._connect_timeout
        )
        try:
            metadata = src_client._checkpoint_metadata(self._group_rank, timeout=self._timeout)
        finally:
            src_client.close()
        pending = self._checkpoint_transport.recv_checkpoint(
            src_rank=src_rank, metadata=metadata, step=quorum.max_step, timeout=self._timeout
        )
        if not isinstance(pending, dict) or "torchft" not in pending or "user" not in pending:
            raise RuntimeError("received checkpoint lacks the 'user'/'torchft' sections")
        self._pre_heal_state = self.state_dict()
        self._pending_state_dict = pending
        # The manager's own counters are restored here, as the reference does; the user state
        # waits for the training thread.
        self.load_state_dict(pending["torchft"])
        self._step = quorum.max_step

    def _apply_pending_state_dict(self) -> None:
        assert self._healing, "must be in healing state"
        self.wait_quorum()
        pending = self._pending_state_dict
        self._pending_state_dict = None
        if pending is None:
            if self._errored is None:
                self.report_error(RuntimeError("healing without a received checkpoint"))
            return
        try:
            user = pending["user"]
            for key, load_fn in self._load_state_dict_fns.items():
                load_fn(user[key])
            self._logger.info("loaded the recovered state dict")
        except Exception as e:
            self._logger.exception(f"loading the recovered state dict failed: {e}")
            self.report_error(e)
            # Not healed after all: report the old step so the next quorum heals again.
            if self._pre_heal_state is not None:
                self.load_state_dict(self._pre_heal_state)
        self._pre_heal_state = None

    def _manager_state_dict(self) -> dict[str, Any]:
        with self._state_dict_lock.r_lock():
            assert self._user_state_dicts, "user state_dict is not initialized."
            return {
                "user": {key: fn() for key, fn in self._user_state_dicts.items()},
                "torchft": self.state_dict(),
            }

    def allow_state_dict_read(self) -> None:
        """Lets peers read the state dict again (releases the writer lock; idempotent)."""
        if self._is_state_dict_read_allowed:
            return
        self._is_state_dict_read_allowed = True
        self._state_dict_lock.w_release()

    def disallow_state_dict_read(self) -> None:
        """Blocks state-dict reads while the state is inconsistent (idempotent)."""
        if not self._is_state_dict_read_allowed:
            return
        self._state_dict_lock.w_acquire()
        self._is_state_dict_read_allowed = False


def _clone_tensors(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a detached copy (containers rebuilt, rest shared)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return type(tree)((k, _clone_tensors(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_clone_tensors(v) for v in tree)
    return tree
