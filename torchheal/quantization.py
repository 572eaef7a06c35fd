"""Per-row 8-bit quantization written with plain torch ops (runs on CPU and on any accelerator).

This is the numeric half of the quantized collectives in :mod:`torchheal.collectives`. Every
input tensor is viewed as a 2-D matrix (dim 0 = rows, the product of the other dims = columns;
1-D and 0-d tensors become ``(n, 1)``). Each row is quantized on its own:

* ``scale = QMAX / absmax(row)`` (``1.0`` for an all-zero row, where the quotient is ``inf``),
* values ``round(x * scale)`` stored as ``int8`` (``QMAX = 127``), or as ``float8_e4m3fn``
  (``QMAX = 448``) on CUDA devices of compute capability >= 9.0, where fp8 is native,
* the row is stored as its fp32 scale (4 bytes) immediately followed by its values, padded so
  every row takes ``(ceil(cols / 4) + 1) * 4`` bytes (4-byte alignment keeps the scale readable
  as fp32 in place).

A *group* buffer holds several tensors for ``group_size`` ranks: it is ``group_size`` equal
chunks, chunk ``r`` holding rows ``[r * R/g, (r + 1) * R/g)`` of every tensor (rows padded with
zeros up to a multiple of ``group_size``). Rank ``r`` of a collective owns chunk ``r``.

The function names of the reference (``fused_*_fp8``) are kept so code written against it
still imports; here they are ordinary torch code, not fused kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed import ReduceOp

__all__ = [
    "SUPPORTED_DTYPES",
    "dequantize_chunk",
    "dequantize_rows",
    "fused_dequantize_from_fp8",
    "fused_quantize_into_fp8",
    "fused_reduce_fp8",
    "group_chunk_bytes",
    "qmax_for",
    "quantize_rows",
    "quantized_dtype_for",
    "row_bytes",
]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

_INT8_MAX = 127.0
_FP8_E4M3_MAX = 448.0
_SCALE_BYTES = 4  # one fp32 scale per row


def quantized_dtype_for(device: torch.device) -> torch.dtype:
    """Element type used to quantize tensors living on ``device``.

    fp8 e4m3 where the hardware has it natively (CUDA compute capability >= 9.0), int8
    everywhere else. Every rank of a collective must pick the same type, which holds when the
    ranks run on the same kind of device.

    Args:
        device: device of the tensors being quantized.
    """
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        return torch.float8_e4m3fn
    return torch.int8


def qmax_for(qdtype: torch.dtype) -> float:
    """Largest magnitude a row is scaled to for the quantized element type ``qdtype``.

    Args:
        qdtype: ``torch.int8`` or ``torch.float8_e4m3fn``.
    """
    if qdtype == torch.int8:
        return _INT8_MAX
    if qdtype == torch.float8_e4m3fn:
        return _FP8_E4M3_MAX
    raise ValueError(f"unsupported quantized dtype {qdtype}; expected int8 or float8_e4m3fn")


def row_bytes(cols: int) -> int:
    """Bytes one quantized row of ``cols`` values takes: fp32 scale + values, 4-byte aligned.

    Args:
        cols: number of values in the row.
    """
    return (math.ceil(cols / 4) + 1) * 4


def _as_matrix_shape(t: torch.Tensor) -> tuple[int, int]:
    """(rows, cols) of the 2-D view of ``t``: 1-D and 0-d tensors are one value per row."""
    if t.dim() <= 1:
        return (t.numel(), 1)
    return (t.shape[0], math.prod(t.shape[1:]))


def quantize_rows(x: torch.Tensor, qdtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Quantize each row of a 2-D tensor into ``row_bytes(cols)`` bytes.

    Args:
        x: 2-D floating tensor (any of :data:`SUPPORTED_DTYPES`).
        qdtype: quantized element type (see :func:`quantized_dtype_for`).

    Returns:
        A ``uint8`` tensor of shape ``(rows, row_bytes(cols))`` on ``x``'s device.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_rows expects a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    qmax = qmax_for(qdtype)
    # fp32 arithmetic: fp16/bf16 would lose precision in the scale and the products.
    xf = x.to(torch.float32)
    absmax = xf.abs().amax(dim=1, keepdim=True) if cols > 0 else xf.new_zeros((rows, 1))
    scale = qmax / absmax
    scale = torch.where(torch.isinf(scale), torch.ones_like(scale), scale)
    scaled = xf * scale
    if qdtype == torch.int8:
        values = scaled.round_().clamp_(-qmax, qmax).to(torch.int8)
    else:
        values = scaled.clamp_(-qmax, qmax).to(qdtype)
    out = torch.zeros((rows, row_bytes(cols)), dtype=torch.uint8, device=x.device)
    out[:, :_SCALE_BYTES] = scale.contiguous().view(torch.uint8)
    out[:, _SCALE_BYTES : _SCALE_BYTES + cols] = values.view(torch.uint8)
    return out


def dequantize_rows(buf: torch.Tensor, cols: int, qdtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: fp32 ``(rows, cols)`` values from quantized rows.

    Args:
        buf: ``uint8`` tensor of shape ``(rows, row_bytes(cols))``.
        cols: number of values per row.
        qdtype: the element type the rows were quantized with.
    """
    if buf.dim() != 2 or buf.shape[1] != row_bytes(cols):
        raise ValueError(
            f"quantized rows of {cols} values need shape (rows, {row_bytes(cols)}), "
            f"got {tuple(buf.shape)}"
        )
    scale = buf[:, :_SCALE_BYTES].contiguous().view(torch.float32)
    values = buf[:, _SCALE_BYTES : _SCALE_BYTES + cols].contiguous().view(qdtype)
    return values.to(torch.float32) / scale


def _check_inputs(inputs: Sequence[torch.Tensor]) -> None:
    if len(inputs) == 0:
        raise ValueError("quantization needs at least one tensor")
    first = inputs[0]
    for t in inputs:
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"quantization supports float32, float16 and bfloat16 tensors, got {t.dtype}"
            )
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                "all tensors must share one dtype and device, got "
                f"{first.dtype}/{first.device} and {t.dtype}/{t.device}"
            )


def _layout(inputs: Sequence[torch.Tensor], group_size: int) -> list[tuple[int, int, int]]:
    """Per tensor: (rows, cols, rows per rank after padding rows to a multiple of group_size)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    out = []
    for t in inputs:
        rows, cols = _as_matrix_shape(t)
        out.append((rows, cols, math.ceil(rows / group_size)))
    return out


def group_chunk_bytes(inputs: Sequence[torch.Tensor], group_size: int) -> int:
    """Bytes of one rank's chunk of the group buffer built from ``inputs``.

    Args:
        inputs: the tensors that go into the buffer.
        group_size: number of ranks (chunks).
    """
    return sum(rpr * row_bytes(cols) for _, cols, rpr in _layout(inputs, group_size))


def fused_quantize_into_fp8(
    inputs: Sequence[torch.Tensor], group_size: int, qdtype: torch.dtype | None = None
) -> torch.Tensor:
    """Quantize ``inputs`` into one flat ``uint8`` group buffer of ``group_size`` chunks.

    Args:
        inputs: tensors of one supported dtype on one device.
        group_size: number of ranks the buffer is split between.
        qdtype: quantized element type; default :func:`quantized_dtype_for` the device.

    Returns:
        ``uint8`` tensor of ``group_size * group_chunk_bytes(inputs, group_size)`` bytes.
    """
    _check_inputs(inputs)
    qdtype = qdtype or quantized_dtype_for(inputs[0].device)
    per_tensor = []
    for t, (rows, cols, rpr) in zip(inputs, _layout(inputs, group_size), strict=True):
        mat = t.detach().reshape(rows, cols)
        padded_rows = rpr * group_size
        if padded_rows != rows:
            mat = torch.cat([mat, mat.new_zeros((padded_rows - rows, cols))])
        q = quantize_rows(mat, qdtype)
        # rank r's rows are contiguous in q; view them as one chunk row per rank.
        per_tensor.append(q.reshape(group_size, rpr * row_bytes(cols)))
    return torch.cat(per_tensor, dim=1).reshape(-1)


def _chunk_pieces(
    inputs: Sequence[torch.Tensor], chunk: torch.Tensor, group_size: int
) -> list[torch.Tensor]:
    """Split rows of a (k, chunk_bytes) view into one (k, rpr * row_bytes) piece per tensor."""
    sizes = [rpr * row_bytes(cols) for _, cols, rpr in _layout(inputs, group_size)]
    return list(torch.split(chunk, sizes, dim=1))


def fused_dequantize_from_fp8(
    inputs: Sequence[torch.Tensor],
    buffer: torch.Tensor,
    group_size: int,
    qdtype: torch.dtype | None = None,
) -> None:
    """Dequantize a whole group buffer back into ``inputs``, in place (cast to their dtype).

    Args:
        inputs: the tensors the buffer was built from; overwritten.
        buffer: flat ``uint8`` group buffer (see :func:`fused_quantize_into_fp8`).
        group_size: number of chunks in the buffer.
        qdtype: quantized element type; default :func:`quantized_dtype_for` the device.
    """
    _check_inputs(inputs)
    qdtype = qdtype or quantized_dtype_for(inputs[0].device)
    chunk_bytes = group_chunk_bytes(inputs, group_size)
    if buffer.numel() != chunk_bytes * group_size:
        raise ValueError(
            f"group buffer has {buffer.numel()} bytes, expected {chunk_bytes * group_size}"
        )
    pieces = _chunk_pieces(inputs, buffer.reshape(group_size, chunk_bytes), group_size)
    for t, piece, (rows, cols, rpr) in zip(
        inputs, pieces, _layout(inputs, group_size), strict=True
    ):
        values = dequantize_rows(piece.reshape(rpr * group_size, row_bytes(cols)), cols, qdtype)
        with torch.no_grad():
            t.copy_(values[:rows].reshape(t.shape))


def dequantize_chunk(
    inputs: Sequence[torch.Tensor],
    chunk: torch.Tensor,
    group_size: int,
    qdtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Dequantize one rank's chunk into fp32 ``(rows per rank, cols)`` slices, one per input.

    Args:
        inputs: the tensors the group buffer was built from (for shapes only).
        chunk: flat ``uint8`` chunk of ``group_chunk_bytes(inputs, group_size)`` bytes.
        group_size: number of ranks of the group buffer.
        qdtype: quantized element type; default :func:`quantized_dtype_for` the device.
    """
    qdtype = qdtype or quantized_dtype_for(inputs[0].device)
    pieces = _chunk_pieces(inputs, chunk.reshape(1, -1), group_size)
    out = []
    for piece, (_, cols, rpr) in zip(pieces, _layout(inputs, group_size), strict=True):
        out.append(dequantize_rows(piece.reshape(rpr, row_bytes(cols)), cols, qdtype))
    return out


def fused_reduce_fp8(
    inputs: Sequence[torch.Tensor],
    buffer: torch.Tensor,
    group_size: int,
    rank: int,
    reduce_op: ReduceOp.RedOpType = ReduceOp.SUM,
    qdtype: torch.dtype | None = None,
) -> None:
    """Reduce the ``group_size`` quantized copies of this rank's slice; requantize in place.

    ``buffer`` is what an all-to-all delivers: chunk ``j`` is rank ``j``'s quantization of the
    slice owned by ``rank``. The copies are dequantized, summed in fp32 (divided by
    ``group_size`` for AVG) and the result is written, requantized, into chunk ``rank``.

    Args:
        inputs: the tensors the group buffer was built from (for shapes only).
        buffer: flat ``uint8`` buffer of ``group_size`` chunks; chunk ``rank`` is overwritten.
        group_size: number of ranks.
        rank: this rank; selects the chunk written.
        reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.AVG``.
        qdtype: quantized element type; default :func:`quantized_dtype_for` the device.
    """
    _check_inputs(inputs)
    # `==`, not `in`: a ReduceOp object never equals a tuple member by identity or hash.
    is_avg = reduce_op == ReduceOp.AVG
    if not (is_avg or reduce_op == ReduceOp.SUM):
        raise NotImplementedError(f"quantized reduction supports SUM and AVG, got {reduce_op}")
    qdtype = qdtype or quantized_dtype_for(inputs[0].device)
    chunk_bytes = group_chunk_bytes(inputs, group_size)
    chunks = buffer.reshape(group_size, chunk_bytes)
    per_tensor_pieces = _chunk_pieces(inputs, chunks, group_size)
    reduced = []
    for piece, (_, cols, rpr) in zip(per_tensor_pieces, _layout(inputs, group_size), strict=True):
        rb = row_bytes(cols)
        # (group_size * rpr, rb) rows: every rank's copy of the same rpr rows, stacked.
        values = dequantize_rows(piece.reshape(group_size * rpr, rb), cols, qdtype)
        total = values.reshape(group_size, rpr, cols).sum(dim=0)
        if is_avg:
            total /= group_size
        reduced.append(quantize_rows(total, qdtype).reshape(1, rpr * rb))
    chunks[rank].copy_(torch.cat(reduced, dim=1).reshape(-1))
