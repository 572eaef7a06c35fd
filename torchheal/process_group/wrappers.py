"""Process groups that wrap another one: the reconfigurable shell and two test/robustness wrappers.

* :class:`ProcessGroupWrapper` - owns an inner group, rebuilt by ``configure`` (or delegates to an
  inner torchheal group); subclasses only say how to build the inner group (``_create_pg``).
* :class:`ErrorSwallowingProcessGroupWrapper` - turns allreduce failures into a stored error.
* :class:`FakeProcessGroupWrapper` - test helper that injects one allreduce failure.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp
from torch.futures import Future

from torchheal.process_group.base import ProcessGroup, quorum_group_name
from torchheal.process_group.store import create_store_client
from torchheal.process_group.work import _chain, _DummyWork, _ErrorRecordingWork

logger = logging.getLogger(__name__)
# Structured failure records, named as the reference's so existing log pipelines match them.
errors_logger = logging.getLogger("torchft_errors")


def _allreduce_opts(opts: AllreduceOptions | ReduceOp) -> AllreduceOptions:
    """Accepts either options or a bare reduce op, as torch's own bindings do."""
    if isinstance(opts, AllreduceOptions):
        return opts
    out = AllreduceOptions()
    out.reduceOp = opts
    return out


class ProcessGroupWrapper(ProcessGroup):
    """A process group that delegates every collective to an inner group.

    Args:
        timeout: timeout of the store client and of the inner group's operations.
        pg: an inner group to wrap. A torchheal :class:`ProcessGroup` is configured by delegation;
            otherwise the inner group is rebuilt by :meth:`_create_pg` on every ``configure``.
    """

    def __init__(
        self, timeout: timedelta = timedelta(seconds=60), pg: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self._pg: dist.ProcessGroup | None = pg
        self._timeout = timeout
        self._replica_id: str | None = None
        self._rank: int | None = None
        self._errored: Exception | None = None
        # What the last configure said about its quorum (see ProcessGroup.configure).
        self._c10d_group_name: str | None = None
        self._global_ranks: list[int] | None = None

    @property
    def parent(self) -> dist.ProcessGroup:
        """The inner group (``AssertionError`` before the first ``configure``)."""
        assert self._pg is not None, "process group not initialized"
        return self._pg

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        """Builds the inner group on a prefixed store client (subclasses implement it).

        Args:
            store: the rendezvous store for this configuration.
            rank: this process's rank.
            world_size: number of members.
        """
        raise NotImplementedError("not implemented")

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        *,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """See :meth:`ProcessGroup.configure`; drops (aborts) the previous inner group first."""
        self._replica_id = replica_id
        self._rank = rank
        self._c10d_group_name = quorum_group_name(quorum_id, group_rank, group_world_size)
        self._global_ranks = list(global_ranks) if global_ranks else None
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            self._errored = None
            pg.configure(
                store_addr,
                replica_id,
                rank,
                world_size,
                quorum_id=quorum_id,
                group_rank=group_rank,
                group_world_size=group_world_size,
                global_ranks=global_ranks,
            )
            return
        self.abort(errored=False)
        # Cleared after the abort: aborting the old group may itself record an error.
        self._errored = None
        store = create_store_client(store_addr, timeout=self._timeout)
        self._pg = self._create_pg(store, rank, world_size)

    def abort(self, errored: bool = True) -> None:
        """Aborts and drops the inner group so anything blocked on it fails.

        Args:
            errored: whether this abort is due to a failure (emits a ``torchft_errors`` record).
        """
        if errored:
            errors_logger.info(
                "",
                extra={
                    "replica_id": self._replica_id,
                    "rank": self._rank,
                    "error": "process_group_abort",
                },
            )
        pg = self._pg
        if pg is not None:
            try:
                pg.abort()
            except Exception:
                # Aborting a broken communicator may itself fail; the group is dropped anyway.
                logger.warning("abort of the inner process group failed", exc_info=True)
        self._pg = None

    def shutdown(self) -> None:
        """Releases the inner group (aborting it so peers blocked on us fail fast)."""
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            pg.shutdown()
            self._pg = None
        else:
            self.abort(errored=False)

    def errored(self) -> Exception | None:
        """The first error seen by a work of the current configuration, or ``None``."""
        if self._errored is not None:
            return self._errored
        if isinstance(self._pg, ProcessGroup):
            return self._pg.errored()
        return None

    def _record_error(self, e: Exception) -> None:
        if self._errored is None:
            self._errored = e

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the timeout used by the next ``configure`` (and the inner torchheal group's).

        Args:
            timeout: the new timeout.
        """
        self._timeout = timeout
        if isinstance(self._pg, ProcessGroup):
            self._pg.set_timeout(timeout)

    def getBackendName(self) -> str:
        """The inner group's backend name."""
        pg = self.parent
        if isinstance(pg, ProcessGroup):
            return pg.getBackendName()
        return pg.name()

    def size(self) -> int:
        """The inner group's size."""
        return self.parent.size()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pg={self._pg})"

    # -- hooks for subclasses ------------------------------------------------------------

    def _run_context(self) -> contextlib.AbstractContextManager[None]:
        """Context every collective call runs in (subclasses add timeouts)."""
        return contextlib.nullcontext()

    def _opts_hook(self, opts: Any) -> Any:
        """Rewrites options before they reach the inner group (identity here)."""
        return opts

    def _wrap_work(self, work: dist.Work, opts: object) -> dist.Work:
        """Wraps the inner group's work (records errors for :meth:`errored`)."""
        return _ErrorRecordingWork(work, self._record_error)

    def _call(self, name: str, *args: Any, opts: Any = None) -> dist.Work:
        with self._run_context():
            fn = getattr(self.parent, name)
            if opts is None:
                work = fn(*args)
            else:
                work = fn(*args, self._opts_hook(opts))
            return self._wrap_work(work, opts)

    # -- collectives -----------------------------------------------------------------------

    def allgather(self, output_tensors, input_tensor, opts) -> dist.Work:
        return self._call("allgather", output_tensors, input_tensor, opts=opts)

    def allgather_into_tensor_coalesced(self, output_tensors, input_tensors, opts) -> dist.Work:
        return self._call(
            "allgather_into_tensor_coalesced", output_tensors, input_tensors, opts=opts
        )

    def allreduce(self, tensors, opts) -> dist.Work:
        return self._call("allreduce", tensors, opts=_allreduce_opts(opts))

    def allreduce_coalesced(self, tensors, opts) -> dist.Work:
        return self._call("allreduce_coalesced", tensors, opts=opts)

    def alltoall_base(
        self, output_buffer, input_buffer, output_split_sizes, input_split_sizes, opts
    ) -> dist.Work:
        return self._call(
            "alltoall_base",
            output_buffer,
            input_buffer,
            output_split_sizes,
            input_split_sizes,
            opts=opts,
        )

    def barrier(self, opts) -> dist.Work:
        return self._call("barrier", opts=opts)

    def broadcast(self, tensor_list, opts) -> dist.Work:
        return self._call("broadcast", tensor_list, opts=opts)

    def recv(self, tensors, src_rank, tag) -> dist.Work:
        return self._call("recv", tensors, src_rank, tag)

    def reduce_scatter(self, output_tensors, input_tensors, opts) -> dist.Work:
        return self._call("reduce_scatter", output_tensors, input_tensors, opts=opts)

    def reduce_scatter_tensor_coalesced(self, output_tensors, input_tensors, opts) -> dist.Work:
        return self._call(
            "reduce_scatter_tensor_coalesced", output_tensors, input_tensors, opts=opts
        )

    def send(self, tensors, dst_rank, tag) -> dist.Work:
        return self._call("send", tensors, dst_rank, tag)


class _ErrorSwallowingWork(dist.Work):
    """A work whose failures are reported to the wrapper instead of raised."""

    def __init__(
        self, pg: ErrorSwallowingProcessGroupWrapper, work: dist.Work, default_result: object
    ) -> None:
        super().__init__()
        self._pg = pg
        self._work = work
        self._default_result = default_result

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits; a failure is stored on the wrapper and ``True`` is returned."""
        try:
            self._work.wait() if timeout is None else self._work.wait(timeout)
        except Exception as e:
            self._pg.report_error(e)
        return True

    def get_future(self) -> Future[object]:
        """A future that resolves to the inputs when the underlying work fails."""

        def _swallow(fut: Future[object]) -> object:
            try:
                return fut.value()
            except Exception as e:
                self._pg.report_error(e)
                return self._default_result

        return _chain(self._work.get_future(), _swallow)


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """Stores allreduce errors instead of raising them; later allreduces become no-ops.

    Only ``allreduce`` is protected (as in the reference).

    Args:
        pg: the group to wrap.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._error: Exception | None = None

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, **quorum: Any
    ) -> None:
        """Clears the stored error and configures the inner group.

        Args:
            store_addr: see :meth:`ProcessGroup.configure`.
            replica_id: see :meth:`ProcessGroup.configure`.
            rank: see :meth:`ProcessGroup.configure`.
            world_size: see :meth:`ProcessGroup.configure`.
            quorum: the optional quorum keywords of :meth:`ProcessGroup.configure`.
        """
        self._error = None
        super().configure(store_addr, replica_id, rank, world_size, **quorum)

    def report_error(self, e: Exception) -> None:
        """Stores ``e`` (later allreduces complete at once without communicating).

        Args:
            e: the error.
        """
        self._error = e

    def error(self) -> Exception | None:
        """The stored error, if any."""
        return self._error

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        if self._error is not None:
            return _DummyWork(tensors)
        try:
            work = super().allreduce(tensors, opts)
        except Exception as e:
            self.report_error(e)
            return _DummyWork(tensors)
        return _ErrorSwallowingWork(self, work, tensors)


class _InjectedErrorWork(dist.Work):
    """A work that raises a given error from ``wait()`` and its future."""

    def __init__(self, work: dist.Work, error: Exception) -> None:
        super().__init__()
        self._work = work
        self._error = error

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Raises the injected error."""
        raise self._error

    def get_future(self) -> Future[object]:
        """A future that fails with the injected error once the real work completes."""
        error = self._error

        def _fail(fut: Future[object]) -> object:
            raise error

        return _chain(self._work.get_future(), _fail)


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """Test helper: makes the next allreduce fail with a chosen error (one shot).

    Args:
        pg: the group to wrap.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._future_error: Exception | None = None

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, **quorum: Any
    ) -> None:
        """Clears any pending injected error and configures the inner group.

        Args:
            store_addr: see :meth:`ProcessGroup.configure`.
            replica_id: see :meth:`ProcessGroup.configure`.
            rank: see :meth:`ProcessGroup.configure`.
            world_size: see :meth:`ProcessGroup.configure`.
            quorum: the optional quorum keywords of :meth:`ProcessGroup.configure`.
        """
        self._future_error = None
        super().configure(store_addr, replica_id, rank, world_size, **quorum)

    def report_future_error(self, e: Exception) -> None:
        """Makes the next allreduce's ``wait()`` and future raise ``e``.

        Args:
            e: the error to inject.
        """
        self._future_error = e

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        work = super().allreduce(tensors, opts)
        error, self._future_error = self._future_error, None
        if error is None:
            return work
        return _InjectedErrorWork(work, error)
