"""Per-row 8-bit quantization written with plain torch ops (runs on CPU and on any accelerator).

Tensors are viewed as 2-D (1-D and 0-d as ``(n, 1)``). Each row is stored as its fp32 scale
``QMAX / absmax`` (1.0 for an all-zero row) followed by its scaled values as int8 (or fp8 e4m3 on
CUDA capability >= 9.0), 4-byte aligned so the scale reads as fp32 in place. A *group* buffer is
``group_size`` chunks, chunk ``r`` holding rows ``[r * R/g, (r + 1) * R/g)`` of every tensor.
The reference's names (``fused_*_fp8``) are kept; these are not fused kernels.
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
    """fp8 e4m3 where the device has it natively (CUDA capability >= 9.0), else int8.

    Every rank of a collective must pick the same type: ranks must run on one kind of device.
    """
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        return torch.float8_e4m3fn
    return torch.int8


def qmax_for(qdtype: torch.dtype) -> float:
    """Largest magnitude a row is scaled to for ``torch.int8`` or ``torch.float8_e4m3fn``."""
    if qdtype == torch.int8:
        return _INT8_MAX
    if qdtype == torch.float8_e4m3fn:
        return _FP8_E4M3_MAX
    raise ValueError(f"unsupported quantized dtype {qdtype}; expected int8 or float8_e4m3fn")


def row_bytes(cols: int) -> int:
    """Bytes one quantized row of ``cols`` values takes: fp32 scale + values, 4-byte aligned."""
    return (math.ceil(cols / 4) + 1) * 4


def _as_matrix_shape(t: torch.Tensor) -> tuple[int, int]:
    """(rows, cols) of the 2-D view of ``t``: 1-D and 0-d tensors are one value per row."""
    if t.dim() <= 1:
        return (t.numel(), 1)
    return (t.shape[0], math.prod(t.shape[1:]))


def quantize_rows(x: torch.Tensor, qdtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Quantize each row of a 2-D tensor: ``uint8`` of shape ``(rows, row_bytes(cols))``."""
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
    """Inverse of :func:`quantize_rows`: fp32 ``(rows, cols)`` values from quantized rows."""
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
    """Bytes of one rank's chunk of the group buffer built from ``inputs``."""
    return sum(rpr * row_bytes(cols) for _, cols, rpr in _layout(inputs, group_size))


def fused_quantize_into_fp8(
    inputs: Sequence[torch.Tensor], group_size: int, qdtype: torch.dtype | None = None
) -> torch.Tensor:
    """Quantize ``inputs`` (one dtype, one device) into one flat ``uint8`` group buffer.

    ``qdtype`` defaults to :func:`quantized_dtype_for` the device (as in the functions below).
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
    """Dequantize a whole group buffer back into ``inputs``, in place (cast to their dtype)."""
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
    """Dequantize one rank's chunk into fp32 ``(rows per rank, cols)`` slices, one per input."""
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

    Chunk ``j`` of ``buffer`` (what an all-to-all delivers) is rank ``j``'s copy of ``rank``'s
    slice; the fp32 sum (or mean) is written, requantized, into chunk ``rank``.
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
