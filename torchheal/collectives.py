"""Quantized allreduce and reduce-scatter built from ordinary collectives and torch ops.

They move 8-bit per-row quantized data (:mod:`torchheal.quantization`) instead of the tensors:

1. quantize every input into one buffer of ``world_size`` chunks (chunk ``r``: rank ``r``'s rows),
2. exchange chunks so each rank holds every rank's copy of its own (``alltoall_base``, or an
   allgather of the whole buffer where the group has no all-to-all),
3. dequantize those copies, reduce them in fp32, requantize,
4. allreduce only: allgather the reduced chunks and dequantize them into the inputs (not waited).

Only ``SUM`` and ``AVG``. Two quantizations bound the error per row (int8: about
``world_size * absmax / 254``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllToAllOptions
from torch.distributed import AllreduceOptions, ReduceOp, ReduceScatterOptions

from torchheal.quantization import (
    dequantize_chunk,
    fused_dequantize_from_fp8,
    fused_quantize_into_fp8,
    fused_reduce_fp8,
    quantized_dtype_for,
)

__all__ = [
    "allocate_reduce_scatter_output",
    "allreduce_quantized",
    "get_padded_sizes",
    "reduce_scatter_quantized",
]


class _FutureWork(dist.Work):
    """A ``Work`` whose completion is a given future (the tail of the quantized pipeline)."""

    def __init__(self, fut: torch.futures.Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._fut.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut


def _reduce_op(opts: object) -> ReduceOp:
    """The ReduceOp of ``opts`` (a ReduceOp or reduce options); only SUM/AVG pass."""
    op = getattr(opts, "reduceOp", opts)
    # Compare with `==`: ReduceOp objects do not hash like their RedOpType members.
    if not (op == ReduceOp.SUM or op == ReduceOp.AVG):
        raise NotImplementedError(f"quantized collectives support only SUM and AVG, got {op}")
    return op


def _check_same_device_dtype(tensors: Sequence[torch.Tensor]) -> None:
    if len(tensors) == 0:
        raise ValueError("expected at least one tensor")
    first = tensors[0]
    for t in tensors:
        if t.device != first.device or t.dtype != first.dtype:
            raise ValueError(
                "all tensors must share one device and dtype, got "
                f"{first.dtype}/{first.device} and {t.dtype}/{t.device}"
            )


@contextmanager
def _work_stream(
    device: torch.device, sync_stream: torch.Stream | None
) -> Iterator[torch.Stream | None]:
    """Run the block on a side stream ordered after the current one; plain on CPU."""
    if device.type == "cpu":
        yield None
        return
    stream = sync_stream if sync_stream is not None else torch.Stream(device=device)
    stream.wait_stream(torch.accelerator.current_stream(device))
    with stream:
        yield stream


def _exchange_chunks(pg: dist.ProcessGroup, qbuf: torch.Tensor, world: int) -> torch.Tensor:
    """All-to-all of equal chunks: returns a buffer whose chunk j is rank j's chunk ``rank``."""
    received = torch.empty_like(qbuf)
    try:
        work = pg.alltoall_base(received, qbuf, [], [], AllToAllOptions())
    except NotImplementedError:
        # No all-to-all: gather every rank's whole buffer and keep our chunk of each.
        gathered = torch.empty((world, qbuf.numel()), dtype=qbuf.dtype, device=qbuf.device)
        pg.allgather([list(gathered.unbind(0))], [qbuf], AllgatherOptions()).wait()
        rank = pg.rank()
        per_rank = gathered.reshape(world, world, -1)
        received.copy_(per_rank[:, rank, :].reshape(-1))
        return received
    work.wait()
    return received


def _quantize_exchange_reduce(
    tensors: Sequence[torch.Tensor], op: ReduceOp, pg: dist.ProcessGroup, qdtype: torch.dtype
) -> torch.Tensor:
    """Steps 1-3: the returned buffer's chunk ``pg.rank()`` holds this rank's reduced slice."""
    world = pg.size()
    qbuf = fused_quantize_into_fp8(tensors, world, qdtype)
    received = _exchange_chunks(pg, qbuf, world)
    fused_reduce_fp8(tensors, received, world, pg.rank(), op, qdtype)
    return received


def allreduce_quantized(
    tensors: list[torch.Tensor],
    opts: AllreduceOptions | ReduceOp,
    process_group: dist.ProcessGroup,
    sync_stream: torch.Stream | None = None,
) -> dist.Work:
    """Allreduce ``tensors`` in place through 8-bit per-row quantization.

    Args:
        tensors: float32/float16/bfloat16 tensors on one device, all of one dtype.
        opts: ``ReduceOp.SUM``/``ReduceOp.AVG`` or ``AllreduceOptions`` carrying one.
        process_group: the group to reduce over (needs ``allgather``, ideally ``alltoall_base``).
        sync_stream: accelerator stream to run on; a new one when None. Ignored on CPU.

    Returns:
        A work whose future resolves to ``tensors`` once they were overwritten.
    """
    op = _reduce_op(opts)
    _check_same_device_dtype(tensors)
    device = tensors[0].device
    world = process_group.size()
    qdtype = quantized_dtype_for(device)
    with _work_stream(device, sync_stream) as stream:
        received = _quantize_exchange_reduce(tensors, op, process_group, qdtype)
        own = received.reshape(world, -1)[process_group.rank()]
        gathered = torch.empty_like(received)
        work = process_group.allgather(
            [list(gathered.reshape(world, -1).unbind(0))], [own], AllgatherOptions()
        )

    def _dequantize(fut: torch.futures.Future) -> list[torch.Tensor]:
        fut.value()  # re-raises a communication error instead of writing garbage
        if stream is None:
            fused_dequantize_from_fp8(tensors, gathered, world, qdtype)
        else:
            with stream:
                fused_dequantize_from_fp8(tensors, gathered, world, qdtype)
        return tensors

    return _FutureWork(work.get_future().then(_dequantize))


def reduce_scatter_quantized(
    output: torch.Tensor,
    inputs: list[torch.Tensor],
    opts: ReduceScatterOptions | ReduceOp,
    process_group: dist.ProcessGroup,
    sync_stream: torch.Stream | None = None,
) -> dist.Work:
    """Reduce ``inputs`` across ranks; write this rank's slice of the result into ``output``.

    Rank ``r`` receives rows ``[r * R/W, (r + 1) * R/W)`` of every input (rows padded to a
    multiple of ``W``), flattened and concatenated in input order.

    Args:
        output: flat tensor from :func:`allocate_reduce_scatter_output`.
        inputs: float32/float16/bfloat16 tensors on one device, all of one dtype.
        opts: ``ReduceOp.SUM``/``ReduceOp.AVG`` or ``ReduceScatterOptions`` carrying one.
        process_group: the group to reduce over.
        sync_stream: accelerator stream to run on; a new one when None. Ignored on CPU.

    Returns:
        A completed work whose future resolves to ``output``.
    """
    op = _reduce_op(opts)
    _check_same_device_dtype(inputs)
    device = inputs[0].device
    world = process_group.size()
    qdtype = quantized_dtype_for(device)
    expected = sum(math.prod(s) // world for s in get_padded_sizes(inputs, world))
    if output.numel() != expected:
        raise ValueError(f"output has {output.numel()} elements, expected {expected}")
    with _work_stream(device, sync_stream):
        received = _quantize_exchange_reduce(inputs, op, process_group, qdtype)
        own = received.reshape(world, -1)[process_group.rank()]
        slices = dequantize_chunk(inputs, own, world, qdtype)
        with torch.no_grad():
            output.copy_(torch.cat([s.reshape(-1) for s in slices]))
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(output)
    return _FutureWork(fut)


def get_padded_sizes(tensors: Sequence[torch.Tensor], world_size: int) -> list[torch.Size]:
    """Shapes of ``tensors`` (1-D as ``(n, 1)``), dim 0 rounded up to a ``world_size`` multiple."""
    sizes = []
    for t in tensors:
        shape = (t.numel(), 1) if t.dim() <= 1 else tuple(t.shape)
        rows = math.ceil(shape[0] / world_size) * world_size
        sizes.append(torch.Size((rows, *shape[1:])))
    return sizes


def allocate_reduce_scatter_output(
    tensors: Sequence[torch.Tensor], world_size: int
) -> tuple[torch.Tensor, list[torch.Size]]:
    """The flat uninitialised output of :func:`reduce_scatter_quantized` for ``tensors``, and
    their padded sizes."""
    _check_same_device_dtype(tensors)
    padded = get_padded_sizes(tensors, world_size)
    numel = sum(math.prod(s) // world_size for s in padded)
    out = torch.empty(numel, dtype=tensors[0].dtype, device=tensors[0].device)
    return out, padded
