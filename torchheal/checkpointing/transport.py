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
    """A checkpoint could not be sent or received: the step must fail, nothing is loaded.

    Raised for integrity failures (size or checksum mismatch, truncated stream), malformed or
    hostile descriptions, refused requests, and transport failures.
    """


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A checkpoint transfer did not complete within its timeout."""


class TornCheckpointError(CheckpointError):
    """A receive into the caller's own tensors (``into``) failed after bytes had landed there.

    Those tensors now hold a mix of their old contents and unverified received bytes: the
    receiver must not train on them, nor send them, until a later receive succeeds.
    """


class CheckpointTransport(ABC, Generic[T]):
    """Moves a replica's state to healing peers; generic over the state type ``T``.

    Its capabilities are the properties below, all False here: a transport that has one
    overrides it (a class attribute will do), and the Manager reads them, never probes.
    """

    @property
    def copies_state(self) -> bool:
        """``send_checkpoint`` serves a private copy taken before it returns: the caller may
        change the state at once, and a healer's download may go on after
        ``disallow_checkpoint`` would be due (the Manager then lets it finish instead of making
        training wait)."""
        return False

    @property
    def copies_on_write(self) -> bool:
        """``send_checkpoint`` serves the state where it lies, and ``disallow_checkpoint`` copies
        what the healers have not yet received before it returns (copy on write): the Manager
        makes no copy of its own, and calls ``disallow_checkpoint`` before the state changes."""
        return False

    @property
    def runs_beside_collectives(self) -> bool:
        """``send_checkpoint`` may run on another thread than the collectives and concurrently
        with them (it does not use the cross-replica process group)."""
        return False

    @property
    def receives_in_place(self) -> bool:
        """``recv_checkpoint`` takes ``into=``, a state of the receiver's own tensors, and
        receives straight into those whose layout matches (no fresh buffers, nothing to copy
        when loading). The bytes land before they are verified: a receive that fails after
        that raises :class:`TornCheckpointError`."""
        return False

    @abstractmethod
    def metadata(self) -> str:
        """Returns the string a healing peer needs to reach this transport.

        Published through the manager server to replicas that must recover from this one.
        """

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Makes ``state_dict`` for ``step`` available to (or sends it to) ``dst_ranks``.

        Called only when some replica is behind. May return before the transfer finishes;
        the state must not be mutated until ``disallow_checkpoint`` returns.

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

        Returns:
            The received state.

        Raises:
            CheckpointError: the transfer failed, timed out or did not verify.
        """

    def abort_receives(self) -> None:
        """Ends the receives in flight now: their ``recv_checkpoint`` raises.

        The Manager calls it when the lighthouse says the source is gone (a frozen or vanished
        host sends no FIN: the receive would otherwise wait for its timeout). The default does
        nothing, and such a receive ends at its timeout.
        """

    def shutdown(self, wait: bool = True) -> None:
        """Releases the transport's resources.

        Args:
            wait: wait for background threads to finish.
        """
