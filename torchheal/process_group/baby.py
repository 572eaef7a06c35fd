"""Process groups whose communicator lives in a child process ("baby" groups): the parent side.

A hung communicator cannot always be aborted in-process; killing a process always works. A fresh
child is spawned on every ``configure``; its loop and the messages live in ``baby_child.py``.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.futures import Future

from torchheal._base.timeouts import to_seconds
from torchheal.multiprocessing import _MonitoredPipe
from torchheal.process_group.baby_child import (
    Call,
    CountWorks,
    Forget,
    FutureDone,
    Wait,
    WatchFuture,
    has_cuda_tensor,
    pack,
    serve,
)
from torchheal.process_group.base import ProcessGroup, check_list_arguments
from torchheal.process_group.gloo import create_gloo_pg

logger = logging.getLogger(__name__)


class _BabyWork(dist.Work):
    """Parent-side handle of an operation running in the child."""

    def __init__(self, pg: ProcessGroupBaby, op_id: int, result: object) -> None:
        super().__init__()
        self._pg = pg
        self._op_id = op_id
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Blocks until the child finished the operation (at most ``timeout`` or the group's)."""
        return self._pg._wait(self._op_id, timeout)

    def get_future(self) -> Future[Any]:
        """A future resolved (with the output tensors) when the child's operation completes."""
        return self._pg._get_future(self._op_id, self._result)

    def synchronize(self) -> None:
        """Not supported: works only synchronize through ``wait``."""
        raise NotImplementedError("_BabyWork.synchronize")

    def __del__(self) -> None:
        # Never touch the pipe from a finalizer (it may run while this thread holds the pipe
        # lock); queue the deletion for the next request instead.
        self._pg._pending_dels.append(self._op_id)


class ProcessGroupBaby(ProcessGroup):
    """Runs a process group in a child process that is replaced on every ``configure``.

    Subclasses implement :meth:`_create_pg` (run in the child).

    Args:
        timeout: configure timeout and default timeout of ``wait``; a ``timedelta`` or seconds.
    """

    def __init__(self, timeout: timedelta | float = 60.0) -> None:
        super().__init__()
        self._timeout = to_seconds(timeout)
        self._world_size = -1
        self._p: Any = None
        self._pipe: _MonitoredPipe | None = None
        self._future_pipe: _MonitoredPipe | None = None
        self._future_thread: threading.Thread | None = None
        self._futures: dict[int, tuple[Future[Any], object]] = {}
        self._futures_lock = threading.Lock()
        self._pipe_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending_dels: deque[int] = deque()
        self._errored: Exception | None = None
        self._configuring: Any = None  # the child of a configure in progress (for abandon)

    @classmethod
    def _create_pg(
        cls, store: dist.Store, rank: int, world_size: int, timeout: timedelta
    ) -> dist.ProcessGroup:
        """Builds the real group inside the child."""
        raise NotImplementedError("not implemented")

    def _on_configure(self) -> None:
        """Runs first in every ``configure`` (subclasses check their device)."""

    # -- lifecycle ---------------------------------------------------------------------------

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, **quorum: Any
    ) -> None:
        """Kills the old child and starts a new one that joins the group at ``store_addr``.

        The quorum keywords are accepted; the child's group is not named after the quorum.

        Raises:
            TimeoutError: if the child did not report ready within the timeout.
            Exception: the child's own error when building the group failed.
        """
        self._on_configure()
        self.shutdown()
        self._world_size = world_size
        self._errored = None
        ctx = mp.get_context("spawn")
        req_local, req_remote = ctx.Pipe()
        fut_local, fut_remote = ctx.Pipe()
        self._pipe = _MonitoredPipe(req_local)
        self._future_pipe = _MonitoredPipe(fut_local)
        device_index = torch.cuda.current_device() if torch.cuda.is_available() else -1
        self._p = ctx.Process(
            target=serve,
            args=(
                type(self)._create_pg,
                store_addr,
                rank,
                world_size,
                req_remote,
                fut_remote,
                device_index,
                self._timeout,
            ),
            daemon=True,
        )
        self._p.start()
        # Only the child holds the remote ends, so its death reads as EOF here.
        req_remote.close()
        fut_remote.close()
        self._future_thread = threading.Thread(
            target=self._future_handler,
            args=(self._future_pipe,),
            name="torchheal-baby-futures",
            daemon=True,
        )
        self._future_thread.start()
        self._configuring = self._p
        try:
            self._pipe.recv(timeout=self._timeout)
            if self._configuring is None:  # abandoned as its child reported ready: killed
                raise RuntimeError("the configure was abandoned")
        except BaseException as e:
            abandoned = self._configuring is None
            self.shutdown()
            if abandoned:
                raise RuntimeError("the configure was abandoned: its child was killed") from e
            raise
        finally:
            self._configuring = None

    def abandon_configure(self) -> None:
        """See :meth:`ProcessGroup.abandon_configure`: kills the child of a configure in progress
        (nothing else reaches its build), so the configure fails at once."""
        child, self._configuring = self._configuring, None
        if child is not None:
            child.kill()

    def shutdown(self) -> None:
        """Kills the child, stops the future thread and closes the pipes (later calls: OSError)."""
        p, thread = self._p, self._future_thread
        self._p = None
        self._future_thread = None
        if p is not None:
            p.kill()
            p.join()
        if thread is not None:
            thread.join(timeout=10)
            if thread.is_alive():
                raise RuntimeError("future thread did not exit")
        for pipe in (self._pipe, self._future_pipe):
            if pipe is not None:
                pipe.close()

    def abort(self) -> None:
        """Kills the child (the surest way to unblock a hung communicator)."""
        self.shutdown()

    def errored(self) -> Exception | None:
        """The first error seen by a wait or future of this configuration, or ``None``."""
        return self._errored

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Sets the configure and default wait timeout."""
        self._timeout = to_seconds(timeout)

    def size(self) -> int:
        """The configured world size (-1 before the first ``configure``)."""
        return self._world_size

    def num_active_work(self) -> int:
        """Number of works the child still holds (after pending deletions are applied)."""
        return self._request(CountWorks, self._timeout)

    # -- pipe plumbing -----------------------------------------------------------------------

    def _live_pipe(self) -> _MonitoredPipe:
        if self._pipe is None:
            raise RuntimeError(f"{type(self).__name__} is not configured")
        return self._pipe

    def _flush_dels(self, pipe: _MonitoredPipe) -> None:
        while self._pending_dels:
            pipe.send(Forget(self._pending_dels.popleft()))

    def _request(self, make: Callable[[int], Any], timeout: float) -> Any:
        """Sends ``make(req_id)`` with a fresh request id; returns the matching reply's value."""
        pipe = self._live_pipe()
        with self._pipe_lock:
            self._flush_dels(pipe)
            req_id = next(self._ids)
            pipe.send(make(req_id))
            while True:
                got_id, value = pipe.recv(timeout=timeout)
                if got_id == req_id:
                    break
                # A late reply to a wait that already timed out: drop it.
        if isinstance(value, BaseException):
            raise value
        return value

    def _run_func(self, name: str, *args: Any) -> dist.Work:
        pipe = self._live_pipe()
        packed = pack(args)
        event = None
        if has_cuda_tensor(args):
            event = torch.cuda.Event(interprocess=True)
            event.record()
        with self._pipe_lock:
            self._flush_dels(pipe)
            op_id = next(self._ids)
            pipe.send(Call(op_id, name, packed, event))
        return _BabyWork(self, op_id, args[0] if args else None)

    def _wait(self, op_id: int, timeout: timedelta | None) -> bool:
        limit = self._timeout if timeout is None else to_seconds(timeout)
        wait_s = None if timeout is None else limit
        try:
            event = self._request(lambda req_id: Wait(req_id, op_id, wait_s), limit)
        except Exception as e:
            if self._errored is None:
                self._errored = e
            raise
        if event is not None:
            event.wait()
        return True

    def _get_future(self, op_id: int, result: object) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._futures_lock:
            self._futures[op_id] = (fut, result)
        pipe = self._live_pipe()
        with self._pipe_lock:
            self._flush_dels(pipe)
            pipe.send(WatchFuture(op_id))
        return fut

    def _future_handler(self, pipe: _MonitoredPipe) -> None:
        """Resolves parent futures from the child's messages until the pipe ends."""
        while True:
            try:
                done: FutureDone = pipe.recv()
            except (EOFError, OSError):
                break
            with self._futures_lock:
                entry = self._futures.pop(done.op_id, None)
            if entry is None:
                continue
            fut, result = entry
            if done.error is None:
                fut.set_result(result)
            else:
                if self._errored is None:
                    self._errored = done.error
                fut.set_exception(done.error)
        with self._futures_lock:
            pending = list(self._futures.values())
            self._futures.clear()
        for fut, _ in pending:
            fut.set_exception(RuntimeError("baby process group child exited"))

    # -- collectives -------------------------------------------------------------------------

    def _collective(self, name: str, *args: Any) -> dist.Work:
        # Checked here: a wrong argument should fail at the call, not inside the child.
        check_list_arguments(name, args)
        return self._run_func(name, *args)


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """A Gloo group in a child process (no reduce_scatter, as Gloo)."""

    @classmethod
    def _create_pg(
        cls, store: dist.Store, rank: int, world_size: int, timeout: timedelta
    ) -> dist.ProcessGroup:
        return create_gloo_pg(store, rank, world_size, timeout)

    def getBackendName(self) -> str:
        """``"torchft-baby-gloo"``."""
        return "torchft-baby-gloo"

    def reduce_scatter(self, output_tensors, input_tensors, opts) -> dist.Work:
        """Not supported by Gloo: raises ``RuntimeError``."""
        raise RuntimeError("ProcessGroupBabyGloo does not support reduce_scatter.")

    def reduce_scatter_tensor_coalesced(self, output_tensors, input_tensors, opts) -> dist.Work:
        """Not supported by Gloo: raises ``RuntimeError``."""
        raise RuntimeError("ProcessGroupBabyGloo does not support reduce_scatter_tensor_coalesced.")


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """An NCCL group in a child process.

    Costs an extra CUDA context per process; works synchronize the stream, not the CPU; compute
    and communication cannot overlap across the two contexts.
    """

    @classmethod
    def _create_pg(
        cls, store: dist.Store, rank: int, world_size: int, timeout: timedelta
    ) -> dist.ProcessGroup:
        from torch.distributed.distributed_c10d import ProcessGroupNCCL as _C10dNCCL

        opts = _C10dNCCL.Options()
        opts._timeout = timeout
        opts.global_ranks_in_group = list(range(world_size))
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        backend = _C10dNCCL(store, rank, world_size, opts)
        backend._set_sequence_number_for_group()
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
        return pg

    def _on_configure(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "ProcessGroupBabyNCCL.configure needs a CUDA device; none is available"
            )

    def getBackendName(self) -> str:
        """``"torchft-baby-nccl"``."""
        return "torchft-baby-nccl"
