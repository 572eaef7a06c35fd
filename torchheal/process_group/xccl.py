"""Reconfigurable XCCL process groups for Intel GPUs (``torch.xpu``), built like the NCCL ones.

Importing and constructing works on any machine (torch's XCCL backend exists only in XPU builds,
so it is imported when a group is built). Not exercised on XPU hardware by this repository's tests.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from torchheal.process_group.baby import ProcessGroupBaby
from torchheal.process_group.wrappers import _TimedProcessGroupWrapper

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
    """Builds a c10d process group backed by a fresh XCCL backend (``RuntimeError`` without one)."""
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


class ProcessGroupXCCL(_TimedProcessGroupWrapper):
    """An XCCL group rebuilt on every ``configure``, aborted when a call overruns its timeout.

    Args:
        timeout: rendezvous timeout and timeout of every operation.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._use_abort = _xpu_available()
        # Unlike the reference, NONBLOCKING_TIMEOUT_ENV is left to the user: every call, the
        # communicator's init included, runs under our timer that aborts the group.

    def _on_configure(self) -> None:
        _require_xpu("ProcessGroupXCCL")

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        pg = create_xccl_pg(store, rank, world_size, self._timeout)
        backend = pg._get_backend(torch.device("xpu"))
        if self._global_ranks:
            backend.options.global_ranks_in_group = list(self._global_ranks)
        if self._c10d_group_name:
            backend.options.group_name = self._c10d_group_name
        return pg

    def errored(self) -> Exception | None:
        """Synchronizes the current XPU stream (if any), then returns the sticky error."""
        if _xpu_available():
            torch.xpu.current_stream().synchronize()
        return self._errored

    def getBackendName(self) -> str:
        """``"torchft-xccl"``."""
        return "torchft-xccl"


class ProcessGroupBabyXCCL(ProcessGroupBaby):
    """An XCCL group in a child process (a hung communicator dies with the child)."""

    @classmethod
    def _create_pg(
        cls, store: dist.Store, rank: int, world_size: int, timeout: timedelta
    ) -> dist.ProcessGroup:
        return create_xccl_pg(store, rank, world_size, timeout)

    def _on_configure(self) -> None:
        _require_xpu("ProcessGroupBabyXCCL")

    def getBackendName(self) -> str:
        """``"torchft-baby-xccl"``."""
        return "torchft-baby-xccl"
