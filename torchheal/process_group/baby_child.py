"""The child side of a baby process group: its messages, and the loop that serves them.

Messages are pickled as :mod:`multiprocessing` does (the child is our own); CPU tensors travel
through shared memory, CUDA tensors as IPC handles. The request pipe carries the messages below
and their replies ``(req_id, value)``, so a reply whose waiter gave up is discarded; its first
message, child -> parent, is ``None`` (ready) or the build's error. The future pipe carries
:class:`FutureDone`.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.futures import Future

from torchheal.process_group.store import create_store_client
from torchheal.process_group.work import _FailedWork

__all__ = [
    "Call",
    "CountWorks",
    "Forget",
    "FutureDone",
    "Wait",
    "WatchFuture",
    "has_cuda_tensor",
    "pack",
    "serve",
]


class Call(NamedTuple):
    """Run a collective in the child (no reply: a failure surfaces from the work)."""

    op_id: int
    name: str
    args: Any
    event: Any  # a CUDA IPC event the child's stream waits on first, or None


class Wait(NamedTuple):
    """Wait for a work (reply ``(req_id, event | None | exception)``)."""

    req_id: int
    op_id: int
    timeout_s: float | None


class WatchFuture(NamedTuple):
    """Send a :class:`FutureDone` when the work's future completes."""

    op_id: int


class Forget(NamedTuple):
    """Drop a work the parent no longer holds."""

    op_id: int


class CountWorks(NamedTuple):
    """How many works the child still holds (reply ``(req_id, count)``)."""

    req_id: int


class FutureDone(NamedTuple):
    """A work's future completed, with its error or None."""

    op_id: int
    error: BaseException | None


_OPTIONS_TAG = "__torchheal_opts__"


def picklable(e: BaseException) -> BaseException:
    """The exception itself if it pickles, else a RuntimeError carrying its text."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def pack(obj: Any) -> Any:
    """Prepares collective arguments for the pipe: shares CPU tensors, flattens options."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            obj.share_memory_()
        return obj
    if isinstance(obj, list):
        return [pack(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(pack(x) for x in obj)
    name = type(obj).__name__
    if name.endswith("Options") and getattr(c10d, name, None) is type(obj):
        # c10d options objects do not pickle; send their public attributes instead.
        attrs = {k: getattr(obj, k) for k in dir(obj) if not k.startswith("_")}
        attrs = {k: v for k, v in attrs.items() if not callable(v) or isinstance(v, dist.ReduceOp)}
        return (_OPTIONS_TAG, name, attrs)
    return obj


def _unpack(obj: Any) -> Any:
    """Inverse of :func:`pack`, in the child (rebuilds options objects)."""
    if isinstance(obj, list):
        return [_unpack(x) for x in obj]
    if isinstance(obj, tuple):
        if len(obj) == 3 and obj[0] == _OPTIONS_TAG:
            opts = getattr(c10d, obj[1])()
            for k, v in obj[2].items():
                setattr(opts, k, v)
            return opts
        return tuple(_unpack(x) for x in obj)
    return obj


def has_cuda_tensor(obj: Any) -> bool:
    """Whether any tensor in ``obj`` (nested lists/tuples) lives on CUDA."""
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, list | tuple):
        return any(has_cuda_tensor(x) for x in obj)
    return False


def serve(
    create_pg: Callable[[dist.Store, int, int, timedelta], dist.ProcessGroup],
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
        pg = create_pg(store, rank, world_size, timedelta(seconds=timeout))
        req_pipe.send(None)
    except Exception as e:
        req_pipe.send(picklable(e))
        return
    _Child(pg, req_pipe, fut_pipe).loop()


class _Child:
    """The child's state: the group, its works, and the side streams of CUDA calls."""

    def __init__(self, pg: dist.ProcessGroup, req_pipe: Any, fut_pipe: Any) -> None:
        self._pg = pg
        self._req_pipe = req_pipe
        self._fut_pipe = fut_pipe
        self._works: dict[int, dist.Work] = {}
        self._streams: dict[int, Any] = {}
        self._fut_lock = threading.Lock()

    def loop(self) -> None:
        handlers: dict[type, Callable[[Any], None]] = {
            Call: self._call,
            Wait: self._wait,
            WatchFuture: self._watch,
            Forget: lambda msg: self._works.pop(msg.op_id, None),
            CountWorks: lambda msg: self._req_pipe.send((msg.req_id, len(self._works))),
        }
        while True:
            try:
                message = self._req_pipe.recv()
            except (EOFError, OSError):
                return
            handlers[type(message)](message)

    def _call(self, msg: Call) -> None:
        try:
            issue = getattr(self._pg, msg.name)
            if msg.event is None:
                self._works[msg.op_id] = issue(*_unpack(msg.args))
                return
            device = torch.cuda.current_device()
            stream = self._streams.setdefault(device, torch.cuda.Stream())
            with torch.cuda.stream(stream):
                msg.event.wait()
                self._works[msg.op_id] = issue(*_unpack(msg.args))
        except Exception as e:
            self._works[msg.op_id] = _FailedWork(picklable(e))  # type: ignore[arg-type]

    def _wait(self, msg: Wait) -> None:
        try:
            work = self._works[msg.op_id]
            if msg.timeout_s is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=msg.timeout_s))
            reply: Any = None
            if self._streams:
                reply = torch.cuda.Event(interprocess=True)
                reply.record(self._streams[torch.cuda.current_device()])
            self._req_pipe.send((msg.req_id, reply))
        except Exception as e:
            self._req_pipe.send((msg.req_id, picklable(e)))

    def _watch(self, msg: WatchFuture) -> None:
        work = self._works.get(msg.op_id) or _FailedWork(KeyError(f"unknown op {msg.op_id}"))
        work.get_future().add_done_callback(lambda fut: self._future_done(msg.op_id, fut))

    def _future_done(self, op_id: int, fut: Future[Any]) -> None:
        try:
            fut.value()
            done = FutureDone(op_id, None)
        except Exception as e:
            done = FutureDone(op_id, picklable(e))
        with self._fut_lock:
            try:
                self._fut_pipe.send(done)
            except OSError:
                pass  # parent gone; nothing to tell
