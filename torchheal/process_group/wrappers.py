"""Process groups that wrap another one: the reconfigurable shell and two test/robustness wrappers.

:class:`ProcessGroupWrapper` owns an inner group rebuilt by ``configure`` (subclasses say how, in
``_create_pg``) or delegates to an inner torchheal group.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from torchheal._base.telemetry_env import job_id
from torchheal.futures import context_timeout
from torchheal.process_group.base import ProcessGroup, quorum_group_name, takes_options
from torchheal.process_group.store import create_store_client
from torchheal.process_group.work import _chain, _DummyWork, _ErrorRecordingWork

logger = logging.getLogger(__name__)
# Structured failure records, named as the reference's so existing log pipelines match them.
errors_logger = logging.getLogger("torchft_errors")


class ProcessGroupWrapper(ProcessGroup):
    """A process group that delegates every collective to an inner group.

    Args:
        timeout: timeout of the store client and of the inner group's operations.
        pg: an inner group to wrap. A torchheal :class:`ProcessGroup` is configured by delegation;
            otherwise the inner group is rebuilt by :meth:`_create_pg` on every ``configure``.
    """

    #: Drop an aborted inner group on a thread of its own (except at shutdown): for backends whose
    #: destructor waits for an operation in flight that the abort may not end (Gloo's).
    _releases_elsewhere: bool = False

    def __init__(
        self, timeout: timedelta = timedelta(seconds=60), pg: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self._pg: dist.ProcessGroup | None = pg
        self._timeout = timeout
        self._replica_id: str | None = None
        self._rank: int | None = None
        self._errored: Exception | None = None
        self._aborted = False
        self._closing = False  # shutdown(): the inner group is released on the caller's thread
        self._abandoned = threading.Event()  # set by abandon_configure
        # What the last configure said about its quorum (see ProcessGroup.configure).
        self._c10d_group_name: str | None = None
        self._global_ranks: list[int] | None = None

    @property
    def parent(self) -> dist.ProcessGroup:
        """The inner group (``AssertionError`` before the first ``configure``)."""
        if self._pg is None:
            # AssertionError as the reference's; after an abort, say so.
            detail = " (aborted; configured again at the next quorum)" if self._aborted else ""
            raise AssertionError(f"process group not initialized{detail}")
        return self._pg

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        """Builds the inner group on a prefixed store client (subclasses implement it)."""
        raise NotImplementedError("not implemented")

    def _on_configure(self) -> None:
        """Runs first in every ``configure``: subclasses check their device or reset state."""

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
        self._on_configure()
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
        self._abandoned.clear()  # an abandon meant for an earlier configure
        store = create_store_client(store_addr, timeout=self._timeout, abandoned=self._abandoned)
        self._pg = self._create_pg(store, rank, world_size)
        self._aborted = False

    def abandon_configure(self) -> None:
        """See :meth:`ProcessGroup.abandon_configure` (passed on to an inner torchheal group)."""
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            pg.abandon_configure()
        else:
            self._abandoned.set()

    def abort(self, errored: bool = True) -> None:
        """Aborts and drops the inner group so anything blocked on it fails.

        Args:
            errored: whether this abort is due to a failure (emits a ``torchft_errors`` record).
        """
        if errored:
            errors_logger.info(
                "",
                extra={
                    "job_id": job_id(),
                    "replica_id": self._replica_id,
                    "rank": self._rank,
                    "error": "process_group_abort",
                },
            )
        self._abort_inner(release_now=self._closing)

    def _abort_inner(self, release_now: bool) -> None:
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            # A torchheal group inside stays: it is configured again later.
            pg.abort()
            return
        self._pg = None
        if pg is None:
            return
        try:
            pg.abort()
        except Exception:
            # Aborting a broken communicator may itself fail; the group is dropped anyway.
            logger.warning("abort of the inner process group failed", exc_info=True)
        self._aborted = True
        if release_now or not self._releases_elsewhere:
            return  # the last reference goes with this frame
        held = [pg]
        del pg
        threading.Thread(target=held.clear, name="torchheal-release-pg", daemon=True).start()

    def shutdown(self) -> None:
        """Releases the inner group (aborting it so peers blocked on us fail fast)."""
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            pg.shutdown()
            self._pg = None
        else:
            # Released on this thread: a release on another thread could race the interpreter's
            # teardown if the process ends right after.
            self._closing = True
            try:
                self.abort(errored=False)
            finally:
                self._closing = False

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
        """Sets the timeout used by the next ``configure`` (and the inner torchheal group's)."""
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
        """Wraps the inner work to record errors (an inner torchheal group keeps its own)."""
        if isinstance(self._pg, ProcessGroup):
            return work
        return _ErrorRecordingWork(work, self._record_error)

    def _collective(self, name: str, *args: Any) -> dist.Work:
        with self._run_context():
            issue = getattr(self.parent, name)
            if not takes_options(name):
                return self._wrap_work(issue(*args), None)
            *leading, opts = args
            return self._wrap_work(issue(*leading, self._opts_hook(opts)), opts)


class _TimedProcessGroupWrapper(ProcessGroupWrapper):
    """An accelerator group whose calls abort it on overrunning the timeout (NCCL, XCCL).

    After an abort :meth:`errored` reports ``"aborted"`` until the next ``configure``.
    """

    def abort(self, errored: bool = True) -> None:
        """Aborts the group; :meth:`errored` reports ``"aborted"`` afterwards.

        Args:
            errored: whether this abort is due to a failure.
        """
        self._errored = RuntimeError("aborted")
        super().abort(errored=errored)

    def _run_context(self) -> contextlib.AbstractContextManager[None]:
        return context_timeout(self.abort, self._timeout)


class _SettledWork(dist.Work):
    """A work whose outcome passes through ``settle`` before its waiter or its future sees it.

    ``settle(finish, fallback)``: ``finish()`` returns the inner outcome or raises; ``settle``
    returns it, returns ``fallback`` (``True`` for ``wait``, ``result`` for the future) or raises.
    """

    def __init__(
        self,
        work: dist.Work,
        settle: Callable[[Callable[[], Any], Any], Any],
        result: object,
    ) -> None:
        super().__init__()
        self._work = work
        self._settle = settle
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits for the inner work, then applies the policy."""

        def finish() -> bool:
            return self._work.wait() if timeout is None else self._work.wait(timeout)

        return self._settle(finish, True)

    def get_future(self) -> Future[object]:
        """The inner work's future, with the policy applied to its outcome."""
        return _chain(self._work.get_future(), lambda fut: self._settle(fut.value, self._result))


class _ErrorSwallowingWork(_SettledWork):
    """An allreduce of :class:`ErrorSwallowingProcessGroupWrapper`: failures stored, not raised."""

    def __init__(
        self, pg: ErrorSwallowingProcessGroupWrapper, work: dist.Work, default_result: object
    ) -> None:
        super().__init__(work, pg._keep_error, default_result)


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """Turns allreduce failures into a stored error; after one, allreduces do not communicate.

    Only ``allreduce`` is protected, as in the reference.

    Args:
        pg: the group to wrap.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._error: Exception | None = None

    def _on_configure(self) -> None:
        self._error = None

    def report_error(self, e: Exception) -> None:
        """Stores ``e``: until the next ``configure``, allreduces complete without communicating."""
        self._error = e

    def error(self) -> Exception | None:
        """The stored error, if any."""
        return self._error

    def _keep_error(self, finish: Callable[[], Any], fallback: Any) -> Any:
        try:
            return finish()
        except Exception as e:
            self.report_error(e)
            return fallback

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        if self._error is None:
            try:
                return _ErrorSwallowingWork(self, super().allreduce(tensors, opts), tensors)
            except Exception as e:
                self.report_error(e)
        # The step has failed already: reducing more would only move garbage.
        return _DummyWork(tensors)


class FakeProcessGroupWrapper(ProcessGroupWrapper):
    """Test helper: the next allreduce fails with a chosen error (once).

    Args:
        pg: the group to wrap.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._future_error: Exception | None = None

    def _on_configure(self) -> None:
        self._future_error = None  # a configure disarms a pending injected error

    def report_future_error(self, e: Exception) -> None:
        """Arms ``e``: the next allreduce completes, then its ``wait()`` and future raise it."""
        self._future_error = e

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        work = super().allreduce(tensors, opts)
        armed, self._future_error = self._future_error, None
        if armed is None:
            return work

        def fail(finish: Callable[[], Any], fallback: Any) -> Any:
            finish()  # the collective itself went through; only its outcome is replaced
            raise armed

        return _SettledWork(work, fail, tensors)
