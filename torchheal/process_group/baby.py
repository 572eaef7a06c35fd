"""Process groups whose communicator lives in a child process ("baby" groups).

A hung or crashed communicator cannot always be aborted in-process; killing a process always
works. :class:`ProcessGroupBaby` spawns a fresh child on every ``configure`` (killing the old
one), and forwards each collective over a request pipe. CPU tensors are moved to shared memory
so the child reduces them in place; CUDA tensors travel as CUDA IPC handles.

Protocol (parent -> child on the request pipe; the child is our own spawned process, so objects
are pickled exactly as :mod:`multiprocessing` does):

* ``("func", op_id, name, args, kwargs, event)`` - call ``pg.name(*args, **kwargs)``, keep the work.
  No reply: a failure is kept as a failed work and surfaces from its ``wait``/future.
* ``("wait", req_id, op_id, timeout)`` -> ``(req_id, event | None | exception)``.
* ``("future", op_id)`` -> later, on the future pipe, ``(op_id, "fut_result", None)`` or
  ``(op_id, "fut_exception", exception)``.
* ``("del", op_id)`` - forget a work; ``("num_active_work", req_id)`` -> ``(req_id, count)``.

Replies carry the request id, so a reply that arrives after its waiter timed out is discarded.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import pickle
import threading
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing
from torch.futures import Future

from torchheal.multiprocessing import _MonitoredPipe
from torchheal.process_group.base import ProcessGroup
from torchheal.process_group.gloo import create_gloo_pg
from torchheal.process_group.store import create_store_client
from torchheal.process_group.work import _FailedWork

logger = logging.getLogger(__name__)

_OPTS_TAG = "__torchheal_opts__"


def _seconds(timeout: timedelta | float) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def _picklable_error(e: BaseException) -> BaseException:
    """The exception itself if it pickles, else a RuntimeError carrying its text."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _pack(obj: Any) -> Any:
    """Prepares arguments for the pipe: shares CPU tensors, flattens options objects."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            obj.share_memory_()
        return obj
    if isinstance(obj, list):
        return [_pack(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_pack(x) for x in obj)
    name = type(obj).__name__
    if name.endswith("Options") and getattr(c10d, name, None) is type(obj):
        # c10d options objects do not pickle; send their public attributes instead.
        attrs = {k: getattr(obj, k) for k in dir(obj) if not k.startswith("_")}
        attrs = {k: v for k, v in attrs.items() if not callable(v) or isinstance(v, dist.ReduceOp)}
        return (_OPTS_TAG, name, attrs)
    return obj


def _unpack(obj: Any) -> Any:
    """Inverse of :func:`_pack` in the child (rebuilds options objects)."""
    if isinstance(obj, list):
        return [_unpack(x) for x in obj]
    if isinstance(obj, tuple):
        if len(obj) == 3 and obj[0] == _OPTS_TAG:
            opts = getattr(c10d, obj[1])()
            for k, v in obj[2].items():
                setattr(opts, k, v)
            return opts
        return tuple(_unpack(x) for x in obj)
    return obj


def _has_cuda_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, list | tuple):
        return any(_has_cuda_tensor(x) for x in obj)
    return False


def _worker(
    cls: type[ProcessGroupBaby],
    store_addr: str,
    rank: int,
    world_size: int,
    req_pipe: Any,
    fut_pipe: Any,
    device_index: int,
    timeout: float,
) -> None:
    """Child process main: build the group, then serve requests until the pipe closes."""
    try:
        if device_index >= 0:
            torch.cuda.set_device(device_index)
        store = create_store_client(store_addr, timeout=timedelta(seconds=timeout))
        pg = cls._create_pg(store, rank, world_size, timedelta(seconds=timeout))
        req_pipe.send(None)
    except Exception as e:
        req_pipe.send(_picklable_error(e))
        return

    works: dict[int, dist.Work] = {}
    streams: dict[int, Any] = {}
    fut_lock = threading.Lock()

    def _send_future(msg: tuple[Any, ...]) -> None:
        with fut_lock:
            try:
                fut_pipe.send(msg)
            except OSError:
                pass  # parent gone; nothing to tell

    def _future_done(op_id: int, fut: Future[Any]) -> None:
        try:
            fut.value()
            _send_future((op_id, "fut_result", None))
        except Exception as e:
            _send_future((op_id, "fut_exception", _picklable_error(e)))

    while True:
        try:
            cmd = req_pipe.recv()
        except (EOFError, OSError):
            return
        kind = cmd[0]
        if kind == "func":
            _, op_id, name, args, kwargs, event = cmd
            try:
                if event is not None:
                    device = torch.cuda.current_device()
                    stream = streams.setdefault(device, torch.cuda.Stream())
                    with torch.cuda.stream(stream):
                        event.wait()
                        works[op_id] = getattr(pg, name)(*_unpack(args), **kwargs)
                else:
                    works[op_id] = getattr(pg, name)(*_unpack(args), **kwargs)
            except Exception as e:
                works[op_id] = _FailedWork(_picklable_error(e))  # type: ignore[arg-type]
        elif kind == "wait":
            _, req_id, op_id, wait_timeout = cmd
            try:
                work = works[op_id]
                if wait_timeout is None:
                    work.wait()
                else:
                    work.wait(timedelta(seconds=wait_timeout))
                reply: Any = None
                if streams:
                    reply = torch.cuda.Event(interprocess=True)
                    reply.record(streams[torch.cuda.current_device()])
                req_pipe.send((req_id, reply))
            except Exception as e:
                req_pipe.send((req_id, _picklable_error(e)))
        elif kind == "future":
            op_id = cmd[1]
            work = works.get(op_id) or _FailedWork(KeyError(f"unknown op {op_id}"))
            work.get_future().add_done_callback(lambda f, op_id=op_id: _future_done(op_id, f))
        elif kind == "del":
            works.pop(cmd[1], None)
        elif kind == "num_active_work":
            req_pipe.send((cmd[1], len(works)))


class _BabyWork(dist.Work):
    """Parent-side handle of an operation running in the child."""

    def __init__(self, pg: ProcessGroupBaby, op_id: int, result: object) -> None:
        super().__init__()
        self._pg = pg
        self._op_id = op_id
        self._result = result

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Blocks until the child finished the operation (at most ``timeout`` or the group's).

        Args:
            timeout: the longest time to block.
        """
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
        self._timeout = _seconds(timeout)
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

    @classmethod
    def _create_pg(
        cls, store: dist.Store, rank: int, world_size: int, timeout: timedelta
    ) -> dist.ProcessGroup:
        """Builds the real group inside the child.

        Args:
            store: prefixed rendezvous store.
            rank: this process's rank.
            world_size: number of members.
            timeout: operation timeout.
        """
        raise NotImplementedError("not implemented")

    # -- lifecycle ---------------------------------------------------------------------------

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Kills the old child and starts a new one that joins the group at ``store_addr``.

        Raises:
            TimeoutError: if the child did not report ready within the timeout.
            Exception: the child's own error when building the group failed.
        """
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
            target=_worker,
            args=(
                type(self),
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
        try:
            self._pipe.recv(timeout=self._timeout)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Kills the child, stops the future thread and closes the pipes.

        Later operations raise ``OSError("handle is closed")``.
        """
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
        """Sets the configure and default wait timeout.

        Args:
            timeout: the new timeout.
        """
        self._timeout = _seconds(timeout)

    def size(self) -> int:
        """The configured world size (-1 before the first ``configure``)."""
        return self._world_size

    def num_active_work(self) -> int:
        """Number of works the child still holds (after pending deletions are applied)."""
        return self._request(("num_active_work",), self._timeout)

    # -- pipe plumbing -----------------------------------------------------------------------

    def _live_pipe(self) -> _MonitoredPipe:
        if self._pipe is None:
            raise RuntimeError(f"{type(self).__name__} is not configured")
        return self._pipe

    def _flush_dels(self, pipe: _MonitoredPipe) -> None:
        while self._pending_dels:
            pipe.send(("del", self._pending_dels.popleft()))

    def _request(self, cmd: tuple[Any, ...], timeout: float) -> Any:
        """Sends ``cmd`` with a fresh request id and returns the matching reply's value."""
        pipe = self._live_pipe()
        with self._pipe_lock:
            self._flush_dels(pipe)
            req_id = next(self._ids)
            pipe.send((cmd[0], req_id, *cmd[1:]))
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
        packed = _pack(args)
        event = None
        if _has_cuda_tensor(args):
            event = torch.cuda.Event(interprocess=True)
            event.record()
        with self._pipe_lock:
            self._flush_dels(pipe)
            op_id = next(self._ids)
            pipe.send(("func", op_id, name, packed, {}, event))
        return _BabyWork(self, op_id, args[0] if args else None)

    def _wait(self, op_id: int, timeout: timedelta | None) -> bool:
        limit = self._timeout if timeout is None else _seconds(timeout)
        try:
            event = self._request(("wait", op_id, None if timeout is None else limit), limit)
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
            pipe.send(("future", op_id))
        return fut

    def _future_handler(self, pipe: _MonitoredPipe) -> None:
        """Resolves parent futures from the child's messages until the pipe ends."""
        while True:
            try:
                op_id, kind, error = pipe.recv()
            except (EOFError, OSError):
                break
            with self._futures_lock:
                entry = self._futures.pop(op_id, None)
            if entry is None:
                continue
            fut, result = entry
            if kind == "fut_result":
                fut.set_result(result)
            else:
                if self._errored is None:
                    self._errored = error
                fut.set_exception(error)
        with self._futures_lock:
            pending = list(self._futures.values())
            self._futures.clear()
        for fut, _ in pending:
            fut.set_exception(RuntimeError("baby process group child exited"))

    # -- collectives -------------------------------------------------------------------------

    @staticmethod
    def _require_list(value: object, what: str) -> None:
        if not isinstance(value, list):
            raise TypeError(f"{what} must be a list, got {type(value).__name__}")

    def allgather(self, output_tensors, input_tensor, opts) -> dist.Work:
        self._require_list(output_tensors, "output_tensors")
        self._require_list(input_tensor, "input_tensor")
        return self._run_func("allgather", output_tensors, input_tensor, opts)

    def allgather_into_tensor_coalesced(self, output_tensors, input_tensors, opts) -> dist.Work:
        self._require_list(output_tensors, "output_tensors")
        self._require_list(input_tensors, "input_tensors")
        return self._run_func(
            "allgather_into_tensor_coalesced", output_tensors, input_tensors, opts
        )

    def allreduce(self, tensors, opts) -> dist.Work:
        self._require_list(tensors, "tensors")
        if not isinstance(opts, c10d.AllreduceOptions):
            op, opts = opts, c10d.AllreduceOptions()
            opts.reduceOp = op
        return self._run_func("allreduce", tensors, opts)

    def allreduce_coalesced(self, tensors, opts) -> dist.Work:
        self._require_list(tensors, "tensors")
        return self._run_func("allreduce_coalesced", tensors, opts)

    def alltoall_base(
        self, output_buffer, input_buffer, output_split_sizes, input_split_sizes, opts
    ) -> dist.Work:
        return self._run_func(
            "alltoall_base",
            output_buffer,
            input_buffer,
            output_split_sizes,
            input_split_sizes,
            opts,
        )

    def barrier(self, opts) -> dist.Work:
        return self._run_func("barrier", opts)

    def broadcast(self, tensor_list, opts) -> dist.Work:
        self._require_list(tensor_list, "tensor_list")
        return self._run_func("broadcast", tensor_list, opts)

    def recv(self, tensors, src_rank, tag) -> dist.Work:
        self._require_list(tensors, "tensors")
        return self._run_func("recv", tensors, src_rank, tag)

    def reduce_scatter(self, output_tensors, input_tensors, opts) -> dist.Work:
        self._require_list(output_tensors, "output_tensors")
        self._require_list(input_tensors, "input_tensors")
        return self._run_func("reduce_scatter", output_tensors, input_tensors, opts)

    def reduce_scatter_tensor_coalesced(self, output_tensors, input_tensors, opts) -> dist.Work:
        self._require_list(output_tensors, "output_tensors")
        self._require_list(input_tensors, "input_tensors")
        return self._run_func(
            "reduce_scatter_tensor_coalesced", output_tensors, input_tensors, opts
        )

    def send(self, tensors, dst_rank, tag) -> dist.Work:
        self._require_list(tensors, "tensors")
        return self._run_func("send", tensors, dst_rank, tag)


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """A Gloo group in a child process (no reduce_scatter, as Gloo).

    Args:
        timeout: configure timeout and default timeout of ``wait``.
    """

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

    Costs an extra CUDA context (about 1 GB) per process; works synchronize the stream, not the
    CPU; compute and communication cannot overlap across the two contexts.

    Args:
        timeout: configure timeout and default timeout of ``wait``.
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

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """See :meth:`ProcessGroupBaby.configure`; raises ``RuntimeError`` at once without CUDA."""
        if not torch.cuda.is_available():
            raise RuntimeError(
                "ProcessGroupBabyNCCL.configure needs a CUDA device; none is available"
            )
        super().configure(store_addr, replica_id, rank, world_size)

    def getBackendName(self) -> str:
        """``"torchft-baby-nccl"``."""
        return "torchft-baby-nccl"
