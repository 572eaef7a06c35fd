"""Wire-format constants and helpers shared by the checkpoint encoder and decoder.

The stream is ``HEADER`` (magic, description length, CRC-32 of the description), the JSON
description, then every storage's bytes cut into ``Segment`` blocks, each with its CRC-32.
"""

from __future__ import annotations

import ctypes
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

try:  # ISA-L's CRC-32: the same checksum as zlib's, about five times faster
    from isal.isal_zlib import crc32 as _fast_crc32
except ImportError:  # pragma: no cover - isal is a dependency; a platform without its wheel
    _fast_crc32 = None

#: ``crc32(data, value=0)``: zlib's CRC-32 (ISA-L's implementation when installed).
crc32: Callable[..., int] = _fast_crc32 if _fast_crc32 is not None else zlib.crc32

MAGIC = b"THCKPT01"
HEADER = struct.Struct("<8sQI")  # magic, description length, crc32(description)
FORMAT = "torchheal.checkpoint"
VERSION = 1
DEFAULT_BLOCK_BYTES = 8 << 20
MAX_DESCRIPTION_BYTES = 256 << 20
MAX_DEPTH = 100
MAX_DIMS = 64


_DTYPE_NAMES_ALLOWED = (
    "float64 float32 float16 bfloat16 complex32 complex64 complex128 int8 int16 int32 int64 "
    "uint8 uint16 uint32 uint64 bool float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz"
).split()
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n)
    for n in _DTYPE_NAMES_ALLOWED
    if isinstance(getattr(torch, n, None), torch.dtype)
}
DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in DTYPES.items()}


def byte_view(buf: torch.Tensor) -> memoryview:
    """A zero-copy writable ``memoryview`` over a contiguous 1-D ``uint8`` CPU tensor.

    The view does not keep ``buf`` alive: the caller must.
    """
    n = buf.numel()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(buf.data_ptr())).cast("B")


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D ``uint8`` tensor aliasing the whole untyped storage of ``t`` (same device)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


@dataclass(frozen=True)
class Segment:
    """One block ``[start, end)`` of storage ``storage``, with its CRC-32: the unit that is
    written, read and checksummed."""

    storage: int
    start: int
    end: int
    crc: int


def split_chunks(segments: Sequence[Segment], num_chunks: int) -> list[list[Segment]]:
    """Splits segments (in stream order) into ``num_chunks`` byte-balanced contiguous runs.

    Both ends compute this from the same description, so a receiver may ask for chunk ``k``
    of ``n`` and know exactly which bytes arrive.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    total = sum(s.end - s.start for s in segments)
    chunks: list[list[Segment]] = [[] for _ in range(num_chunks)]
    offset = 0
    for seg in segments:
        k = min(num_chunks - 1, offset * num_chunks // total) if total else 0
        chunks[k].append(seg)
        offset += seg.end - seg.start
    return chunks


def segments_of(storages: Sequence[Mapping[str, Any]], block_bytes: int) -> list[Segment]:
    """All blocks of all storages (``{"nbytes", "crc"}`` entries), in stream order."""
    out = []
    for i, s in enumerate(storages):
        for j, crc in enumerate(s["crc"]):
            start = j * block_bytes
            out.append(Segment(i, start, min(start + block_bytes, s["nbytes"]), crc))
    return out
