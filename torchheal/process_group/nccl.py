"""Reconfigurable NCCL process group that aborts its communicator instead of hanging.

NCCL collectives can block forever when a peer dies, so every call runs under a timer that aborts
the communicator. With NCCL >= 2.25 works also watch the CUDA stream, and the ops' own timeouts
are reset so NCCL's watchdog never kills the process. Constructing works without CUDA.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from torchheal.futures import context_timeout, stream_timeout
from torchheal.process_group.work import _chain
from torchheal.process_group.wrappers import _TimedProcessGroupWrapper

logger = logging.getLogger(__name__)


def _nccl_supports_abort() -> bool:
    """Whether NCCL can abort a non-blocking communicator safely (NCCL >= 2.25)."""
    if not torch.cuda.is_available():
        return False
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        return False
    return tuple(version[:2]) >= (2, 25)


class _WorkAcceleratorTimeout(dist.Work):
    """Aborts the group when the work, or the stream it was queued on, is late."""

    def __init__(self, pg: ProcessGroupNCCL, work: dist.Work, timeout: timedelta) -> None:
        super().__init__()
        self._pg = pg
        self._work = work
        self._timeout = timeout

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits for the work, then watches the stream (and synchronizes it if ``timeout``)."""
        limit = timeout if timeout is not None else self._timeout
        try:
            with context_timeout(self._pg.abort, limit):
                self._work.wait()
            stream_timeout(self._pg.abort, limit)
            if timeout is not None:
                with context_timeout(self._pg.abort, limit):
                    torch.cuda.current_stream().synchronize()
        except Exception as e:
            self._pg._record_error(e)
            raise
        return True

    def get_future(self) -> Future[Any]:
        """The work's future; on completion the stream is watched as in :meth:`wait`."""
        pg, limit = self._pg, self._timeout

        def _watch(fut: Future[Any]) -> Any:
            try:
                value = fut.value()
            except Exception as e:
                pg._record_error(e)
                raise
            stream_timeout(pg.abort, limit)
            return value

        return _chain(self._work.get_future(), _watch)


class ProcessGroupNCCL(_TimedProcessGroupWrapper):
    """An NCCL process group with a non-blocking communicator, rebuilt on every ``configure``.

    Args:
        timeout: rendezvous timeout and timeout of every operation.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._use_abort = _nccl_supports_abort()

    def _on_configure(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("ProcessGroupNCCL.configure needs a CUDA device; none is available")

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        from torch.distributed.distributed_c10d import ProcessGroupNCCL as _C10dNCCL

        opts = _C10dNCCL.Options()
        opts.config.blocking = False
        opts.global_ranks_in_group = list(self._global_ranks or range(world_size))
        if self._c10d_group_name:
            opts.group_name = self._c10d_group_name
        opts._timeout = self._timeout
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        backend = _C10dNCCL(store, rank, world_size, opts)
        backend._set_sequence_number_for_group()
        device = torch.device("cuda", torch.cuda.current_device())
        # A non-blocking init would wait out TORCH_NCCL_NONBLOCKING_TIMEOUT (30 min, not ours to
        # write): our timer aborts the half-built communicator after the group's timeout.
        with context_timeout(backend.abort, self._timeout):
            backend.eager_connect_single_device(device)
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
        return pg

    def errored(self) -> Exception | None:
        """Synchronizes the current stream, then returns the sticky error."""
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        return self._errored

    def getBackendName(self) -> str:
        """``"torchft-nccl"``."""
        return "torchft-nccl"

    def _opts_hook(self, opts: Any) -> Any:
        if self._use_abort and hasattr(opts, "timeout"):
            # NCCL's watchdog kills the process on an op timeout; we abort instead.
            opts.timeout = type(opts)().timeout
        return opts

    def _wrap_work(self, work: dist.Work, opts: object) -> dist.Work:
        if not self._use_abort:
            return super()._wrap_work(work, opts)
        timeout = self._timeout
        op_timeout = getattr(opts, "timeout", None)
        if isinstance(op_timeout, timedelta) and op_timeout > timedelta(0):
            timeout = op_timeout
        return _WorkAcceleratorTimeout(self, work, timeout)
