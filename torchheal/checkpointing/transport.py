"""The checkpoint transport interface used by the Manager to heal a replica live.

A healthy replica ``send_checkpoint``s its state when a peer is behind; the healing peer
``recv_checkpoint``s it, using the string its source published via ``metadata()`` (for HTTP,
the URL of the source's server). Implementations: ``HTTPTransport`` and ``PGTransport``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, TypeVar

T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint could not be sent or received (integrity, malformed data, refusal,
    transport failure): the step must fail, nothing is loaded."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A checkpoint transfer did not complete within its timeout."""


class TornCheckpointError(CheckpointError):
    """A receive into the caller's own tensors (``into``) failed after bytes had landed there:
    they must not be trained on nor sent until a later receive succeeds."""


class CheckpointTransport(ABC, Generic[T]):
    """Moves a replica's state to healing peers; generic over the state type ``T``.

    Its capabilities are the properties below, all False here: a transport overrides those it
    has (a class attribute will do), so the Manager reads them rather than probes.
    """

    @property
    def copies_state(self) -> bool:
        """``send_checkpoint`` serves a private copy taken before it returns: the state may
        change at once, and a download may outlive ``disallow_checkpoint``."""
        return False

    @property
    def copies_on_write(self) -> bool:
        """``send_checkpoint`` serves the state where it lies and ``disallow_checkpoint`` copies
        what is still to be sent: the Manager makes no copy, and calls it before the state
        changes."""
        return False

    @property
    def runs_beside_collectives(self) -> bool:
        """``send_checkpoint`` may run concurrently with the collectives (it does not use the
        cross-replica process group)."""
        return False

    @property
    def receives_in_place(self) -> bool:
        """``recv_checkpoint`` takes ``into=``, the receiver's own state, and receives straight
        into matching tensors; a receive failing after bytes landed raises
        :class:`TornCheckpointError`."""
        return False

    @abstractmethod
    def metadata(self) -> str:
        """Returns the string a healing peer needs to reach this transport."""

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Makes ``state_dict`` for ``step`` available to (or sends it to) ``dst_ranks``.

        May return before the transfer finishes; the state must not be mutated until
        ``disallow_checkpoint`` returns.

        Args:
            dst_ranks: replica ranks that will receive the checkpoint.
            step: the step the state belongs to.
            state_dict: the state to send.
            timeout: bound on the transfer's waits.
        """

    def disallow_checkpoint(self) -> None:
        """Stops serving the checkpoint; after it returns the state may be mutated."""

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Receives the checkpoint for ``step`` from the replica at ``src_rank``.

        Args:
            src_rank: replica rank of the source.
            metadata: the source's ``metadata()`` string.
            step: the step expected; any other step is an error.
            timeout: bound on the transfer's waits.

        Raises:
            CheckpointError: the transfer failed, timed out or did not verify.
        """

    def abort_receives(self) -> None:
        """Ends the receives in flight now: their ``recv_checkpoint`` raises.

        Called when the source is gone (a vanished host sends no FIN); by default such a
        receive ends at its timeout.
        """

    def shutdown(self, wait: bool = True) -> None:
        """Releases the transport's resources; ``wait`` for background threads to finish."""
