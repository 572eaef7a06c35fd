"""Reconfigurable XCCL process groups for Intel GPUs (``torch.xpu``), built like the NCCL ones.

* :class:`ProcessGroupXCCL` - an XCCL group rebuilt on every ``configure``; every call runs under
  a :func:`~torchheal.futures.context_timeout` that aborts the group instead of hanging.
* :class:`ProcessGroupBabyXCCL` - the same group in a child process (see ``baby.py``).

Importing and constructing both works on any machine: torch's XCCL backend exists only in XPU
builds, so it is imported inside ``_create_pg``, and ``configure`` raises a clear
``RuntimeError`` when no XPU device is available. Not exercised on XPU hardware in this
repository's tests (none is available); the CPU-side behaviour is.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from torchheal.futures import context_timeout
from torchheal.process_group.baby import ProcessGroupBaby
from torchheal.process_group.wrappers import ProcessGroupWrapper

logger = logging.getLogger(__name__)

NONBLOCKING_TIMEOUT_ENV = "TORCH_XCCL_NONBLOCKING_TIMEOUT"


def _xpu_available() -> bool:
    xpu = getattr(torch, "xpu", None)
    return xpu is not None and xpu.is_available()


def _require_xpu(name: str) -> None:
    if not _xpu_available():
        raise RuntimeError(f"{name}.configure needs an Intel XPU device; none is available")


def create_xccl_pg(
    store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> dist.ProcessGroup:
    """Builds a c10d process group backed by a fresh XCCL backend on the current XPU.

    Args:
        store: the (prefixed) rendezvous store.
        rank: this process's rank.
        world_size: number of members.
        timeout: operation timeout.

    Raises:
        RuntimeError: this torch build has no XCCL backend.
    """
    try:
        from torch.distributed import ProcessGroupXCCL as _C10dXCCL  # XPU builds only
    except ImportError as e:
        raise RuntimeError("this torch build has no XCCL backend (torch.xpu builds only)") from e
    opts = _C10dXCCL.Options()
    opts._timeout = timeout
    opts.global_ranks_in_group = list(range(world_size))
    pg = dist.ProcessGroup(store, rank, world_size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.XCCL)
    backend = _C10dXCCL(store, rank, world_size, opts)
    backend._set_sequence_number_for_group()
    pg._register_backend(torch.device("xpu"), dist.ProcessGroup.BackendType.XCCL, backend)
    return pg


class ProcessGroupXCCL(ProcessGroupWrapper):
    """An XCCL group rebuilt on every ``configure``, aborted when a call overruns its timeout.

    After an abort :meth:`errored` reports ``"aborted"`` until the next ``configure``.

    Args:
        timeout: rendezvous timeout and timeout of every operation.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._use_abort = _xpu_available()
        # Unlike the reference, NONBLOCKING_TIMEOUT_ENV is left to the user (torchheal never
        # writes the environment): every call, the first one that waits on the communicator's
        # init included, runs under our own timer that aborts the group (_run_context).

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, **quorum: Any
    ) -> None:
        """See :meth:`ProcessGroup.configure`; raises ``RuntimeError`` at once without an XPU.

        Args:
            store_addr: see :meth:`ProcessGroup.configure`.
            replica_id: see :meth:`ProcessGroup.configure`.
            rank: see :meth:`ProcessGroup.configure`.
            world_size: see :meth:`ProcessGroup.configure`.
            quorum: the optional quorum keywords of :meth:`ProcessGroup.configure`.
        """
        _require_xpu("ProcessGroupXCCL")
        super().configure(store_addr, replica_id, rank, world_size, **quorum)

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        pg = create_xccl_pg(store, rank, world_size, self._timeout)
        backend = pg._get_backend(torch.device("xpu"))
        if self._global_ranks:
            backend.options.global_ranks_in_group = list(self._global_ranks)
        if self._c10d_group_name:
            backend.options.group_name = self._c10d_group_name
        return pg

    def abort(self, errored: bool = True) -> None:
        """Aborts the group; :meth:`errored` reports ``"aborted"`` afterwards.

        Args:
            errored: whether this abort is due to a failure.
        """
        self._errored = RuntimeError("aborted")
        super().abort(errored=errored)

    def errored(self) -> Exception | None:
        """Synchronizes the current XPU stream (if any), then returns the sticky error."""
        if _xpu_available():
            torch.xpu.current_stream().synchronize()
        return self._errored

    def getBackendName(self) -> str:
        """``"torchft-xccl"``."""
        return "torchft-xccl"

    def _run_context(self) -> contextlib.AbstractContextManager[None]:
        return context_timeout(self.abort, self._timeout)


class ProcessGroupBabyXCCL(ProcessGroupBaby):
    """An XCCL group in a child process (a hung communicator dies with the child).

    Args:
        timeout: configure timeout and default timeout of ``wait``.
    """

    @classmethod
    def _create_pg(
        cls, store: dist.Store, rank: int, world_size: int, timeout: timedelta
    ) -> dist.ProcessGroup:
        return create_xccl_pg(store, rank, world_size, timeout)

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, **quorum: Any
    ) -> None:
        """See :meth:`ProcessGroupBaby.configure`; raises ``RuntimeError`` at once without an XPU.

        Args:
            store_addr: see :meth:`ProcessGroup.configure`.
            replica_id: see :meth:`ProcessGroup.configure`.
            rank: see :meth:`ProcessGroup.configure`.
            world_size: see :meth:`ProcessGroup.configure`.
            quorum: the optional quorum keywords of :meth:`ProcessGroup.configure` (the child
                process's group is not named).
        """
        _require_xpu("ProcessGroupBabyXCCL")
        super().configure(store_addr, replica_id, rank, world_size)

    def getBackendName(self) -> str:
        """``"torchft-baby-xccl"``."""
        return "torchft-baby-xccl"
