"""Pickle-free checkpoint encoding: a JSON description plus raw tensor bytes, verified.

``stage`` turns a state dict into a JSON *description* (the tree, one entry per tensor, one per
distinct storage with a CRC-32 per block) and the raw bytes of each distinct storage; as in the
reference, a view sends its whole storage. Receiving lives in ``deserialization`` (re-exported).

CRC-32 per block is cheap next to the wire and lets a transfer be split over connections; it
detects corruption and truncation, not tampering: use the transport token (and TLS) for that.
"""

from __future__ import annotations

import json
import os
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from torchheal.checkpointing._dtensor import describe_dtensor
from torchheal.checkpointing._format import (
    DEFAULT_BLOCK_BYTES,
    DTYPE_NAMES,
    FORMAT,
    HEADER,
    MAGIC,
    MAX_DEPTH,
    VERSION,
    Segment,
    byte_view,
    crc32,
    segments_of,
    split_chunks,
    storage_bytes,
)
from torchheal.checkpointing._memory import empty_populated
from torchheal.checkpointing.deserialization import (
    Description,
    TensorSpec,
    allocate_buffers,
    decode_bytes,
    parse_description,
    parse_header,
    read_segments,
    rebuild,
    verify_segment,
)
from torchheal.checkpointing.transport import CheckpointError
from torchheal.utils import dtensor_type

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "HEADER",
    "Description",
    "Segment",
    "StagedCheckpoint",
    "StagingPool",
    "TensorSpec",
    "allocate_buffers",
    "byte_view",
    "decode_bytes",
    "encode_bytes",
    "parse_description",
    "parse_header",
    "read_segments",
    "rebuild",
    "split_chunks",
    "stage",
    "verify_segment",
]

_PARALLEL_CRC_BYTES = 64 << 20
#: Copy and checksum this much at a time, so the checksum reads bytes still in the cache.
_FUSED_BYTES = 1 << 20


class StagingPool:
    """Reusable CPU byte buffers, by size, for the private copies a sender stages.

    Fresh pages cost a fault and zeroing, more than the copy into them, so a sender reuses its
    buffers between heals (about one state's worth of host memory once it has served).
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D ``uint8`` CPU buffer of ``nbytes`` (a kept one when there is one)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        # Its pages faulted in at once: a copy into fresh pages faults each one (4x slower).
        return empty_populated(nbytes)

    def give_back(self, buffers: Sequence[torch.Tensor]) -> None:
        """Keeps ``buffers`` for later :meth:`take` calls (the caller no longer reads them)."""
        with self._lock:
            for buf in buffers:
                self._free.setdefault(buf.numel(), []).append(buf)

    @property
    def nbytes(self) -> int:
        """Bytes held for reuse."""
        with self._lock:
            return sum(n * len(bufs) for n, bufs in self._free.items())


@dataclass(frozen=True)
class StagedCheckpoint:
    """A state dict ready to send: its JSON description and one 1-D ``uint8`` CPU buffer per
    storage, cut into ``segments`` (stream order, with their CRCs)."""

    step: int
    description: bytes
    buffers: tuple[torch.Tensor, ...]
    segments: tuple[Segment, ...]
    #: Per buffer: it is the caller's own storage (served from where it lies), not a copy.
    live: tuple[bool, ...] = ()

    @property
    def private(self) -> list[torch.Tensor]:
        """The buffers that are copies (taken from the pool), not the caller's storages."""
        return [b for i, b in enumerate(self.buffers) if not (self.live and self.live[i])]

    @property
    def header(self) -> bytes:
        """The frame header preceding the description."""
        return HEADER.pack(MAGIC, len(self.description), zlib.crc32(self.description))

    @property
    def data_bytes(self) -> int:
        """Total bytes of tensor data."""
        return sum(b.numel() for b in self.buffers)

    def write_segments(
        self, write: Callable[[memoryview], object], segments: Sequence[Segment]
    ) -> None:
        """Writes the bytes of ``segments`` with one ``write`` each, without copying."""
        views = [byte_view(b) for b in self.buffers]
        for seg in segments:
            write(views[seg.storage][seg.start : seg.end])


class _Encoder:
    """Walks a state dict into a JSON tree, collecting tensors and their storages (see
    ``stage`` for ``pool`` and ``live_from``)."""

    def __init__(self, pool: StagingPool | None = None, live_from: int | None = None) -> None:
        self.tensors: list[dict[str, Any]] = []
        self.buffers: list[torch.Tensor] = []
        self.live: list[bool] = []
        # With a pool: the storage each copied buffer comes from (filled by _copy_checksums).
        self.sources: list[torch.Tensor] = []
        # The buffers (indices) that are copied from ``sources``, in the same order.
        self.copied: list[int] = []
        self._pool = pool
        self._live_from = live_from
        self._storage_ids: dict[tuple[str, int, int], int] = {}
        self._dtensor = dtensor_type()

    def node(self, value: Any, path: str, depth: int) -> dict[str, Any]:
        if depth > MAX_DEPTH:
            raise CheckpointError(f"state dict nested deeper than {MAX_DEPTH} at {path}")
        if isinstance(value, torch.Tensor):
            return {"t": "tensor", "i": self.tensor(value, path)}
        if isinstance(value, OrderedDict | dict):
            kind = "odict" if isinstance(value, OrderedDict) else "dict"
            keys, values = [], []
            for k, v in value.items():
                keys.append(self.plain(k, f"{path} (key {k!r})"))
                values.append(self.node(v, f"{path}[{k!r}]", depth + 1))
            return {"t": kind, "k": keys, "v": values}
        if type(value) in (list, tuple):
            kind = "list" if type(value) is list else "tuple"
            return {
                "t": kind,
                "v": [self.node(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)],
            }
        return self.plain(value, path)

    def plain(self, value: Any, path: str) -> dict[str, Any]:
        if value is None:
            return {"t": "none"}
        if isinstance(value, bool):
            return {"t": "bool", "v": bool(value)}
        if isinstance(value, int):
            return {"t": "int", "v": int(value)}
        if isinstance(value, float):
            return {"t": "float", "v": float(value).hex()}  # exact, and covers inf/nan
        if isinstance(value, str):
            return {"t": "str", "v": str(value)}
        if isinstance(value, bytes | bytearray):
            return {"t": "bytes", "v": bytes(value).hex()}
        if isinstance(value, torch.dtype) and value in DTYPE_NAMES:
            return {"t": "dtype", "v": DTYPE_NAMES[value]}
        if isinstance(value, torch.device):
            return {"t": "device", "v": str(value)}
        if isinstance(value, torch.Size):
            return {"t": "size", "v": [int(d) for d in value]}
        if type(value) is tuple:  # tuple keys
            return {"t": "tuple", "v": [self.plain(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        raise CheckpointError(
            f"cannot send {type(value).__module__}.{type(value).__qualname__} at {path}: only "
            "tensors, dict/OrderedDict/list/tuple and int/float/bool/str/bytes/None are allowed"
        )

    def tensor(self, t: torch.Tensor, path: str) -> int:
        entry: dict[str, Any] = {}
        if self._dtensor is not None and isinstance(t, self._dtensor):
            entry["dtensor"] = describe_dtensor(t)
            t = t.to_local()
        if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
            raise CheckpointError(f"cannot send tensor at {path}: layout {t.layout} on {t.device}")
        if t.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"cannot send tensor at {path}: unsupported dtype {t.dtype}")
        t = t.detach()
        if t.is_conj() or t.is_neg():
            # The lazy conj/neg bit is not in the bytes: materialise it.
            t = t.resolve_conj().resolve_neg()
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr(), storage.nbytes())
        index = self._storage_ids.get(key)
        if index is None:
            buf = storage_bytes(t)
            index = self._storage_ids[key] = len(self.buffers)
            live = buf.device.type == "cpu" and (
                self._pool is None
                or (self._live_from is not None and buf.numel() >= self._live_from)
            )
            if not live and self._pool is not None:
                self.sources.append(buf)
                self.copied.append(index)
                buf = self._pool.take(buf.numel())
            elif not live:
                buf = buf.to("cpu")  # the staging copy; CPU tensors are served by reference
            self.buffers.append(buf)
            self.live.append(live)
        entry.update(
            s=index,
            dtype=DTYPE_NAMES[t.dtype],
            shape=list(t.shape),
            stride=list(t.stride()),
            offset=t.storage_offset(),
        )
        self.tensors.append(entry)
        return len(self.tensors) - 1


def _checksums(buffers: Sequence[torch.Tensor], block_bytes: int) -> list[list[int]]:
    """CRC-32 per block of every buffer; in parallel threads for big states (zlib drops the GIL)."""
    jobs = [(i, start) for i, b in enumerate(buffers) for start in range(0, b.numel(), block_bytes)]
    views = [byte_view(b) for b in buffers]

    def one(job: tuple[int, int]) -> int:
        i, start = job
        return crc32(views[i][start : start + block_bytes])

    total = sum(b.numel() for b in buffers)
    workers = min(8, os.cpu_count() or 1)
    if total >= _PARALLEL_CRC_BYTES and workers > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="torchheal-crc") as pool:
            crcs = list(pool.map(one, jobs))
    else:
        crcs = [one(j) for j in jobs]
    out: list[list[int]] = [[] for _ in buffers]
    for (i, _), c in zip(jobs, crcs, strict=True):
        out[i].append(c)
    return out


def _copy_checksums(
    sources: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], block_bytes: int
) -> list[list[int]]:
    """Copies each source storage into its buffer and checksums every block of the copy.

    Each megabyte is checksummed right after it is copied, while it is still in the cache.
    """
    out: list[list[int]] = []
    with torch.no_grad():
        for src, dst in zip(sources, buffers, strict=True):
            view = byte_view(dst)
            crcs = []
            for start in range(0, dst.numel(), block_bytes):
                end = min(start + block_bytes, dst.numel())
                crc = 0
                for a in range(start, end, _FUSED_BYTES):
                    b = min(a + _FUSED_BYTES, end)
                    dst[a:b].copy_(src[a:b])
                    crc = crc32(view[a:b], crc)
                crcs.append(crc)
            out.append(crcs)
    return out


def stage(
    state: Any,
    step: int,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    pool: StagingPool | None = None,
    live_from: int | None = None,
) -> StagedCheckpoint:
    """Encodes ``state`` for sending: description, CPU storage bytes and checksums.

    Without a ``pool``, CPU tensors are referenced, not copied: the caller must not mutate them
    until the transfer is over. With a ``pool``, every storage is copied into a pool buffer: the
    caller may mutate the state at once, and gives the copies back
    (``pool.give_back(staged.private)``) once they are no longer served. With ``live_from`` too,
    CPU storages of at least that many bytes are referenced (``staged.live``), not copied.

    ``state`` nests dict/OrderedDict/list/tuple over tensors (DTensors send their local shard)
    and plain values; anything else raises ``CheckpointError`` naming its key path.
    """
    if block_bytes < 4096:
        raise ValueError(f"block_bytes must be >= 4096, got {block_bytes}")
    enc = _Encoder(pool, live_from)
    try:
        with torch.no_grad():
            tree = enc.node(state, "state", 0)
        if pool is not None:
            copied = [enc.buffers[i] for i in enc.copied]
            copied_crcs = iter(_copy_checksums(enc.sources, copied, block_bytes))
            referenced = [b for i, b in enumerate(enc.buffers) if enc.live[i]]
            live_crcs = iter(_checksums(referenced, block_bytes))
            crcs = [next(live_crcs) if live else next(copied_crcs) for live in enc.live]
        else:
            crcs = _checksums(enc.buffers, block_bytes)
    except BaseException:
        if pool is not None:
            pool.give_back([enc.buffers[i] for i in enc.copied])  # nothing is served from them
        raise
    if any(b.device.type != "cpu" for b in enc.buffers):  # pragma: no cover - defensive
        raise CheckpointError("internal error: staging left a buffer off the CPU")
    storages = [{"nbytes": b.numel(), "crc": c} for b, c in zip(enc.buffers, crcs, strict=True)]
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(step),
        "block": block_bytes,
        "storages": storages,
        "tensors": enc.tensors,
        "tree": tree,
    }
    description = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return StagedCheckpoint(
        step=int(step),
        description=description,
        buffers=tuple(enc.buffers),
        segments=tuple(segments_of(storages, block_bytes)),
        live=tuple(enc.live),
    )


def encode_bytes(state: Any, step: int, block_bytes: int = DEFAULT_BLOCK_BYTES) -> bytes:
    """Encodes a state dict into one framed byte string (for tests and small states)."""
    staged = stage(state, step, block_bytes=block_bytes)
    parts: list[bytes] = [staged.header, staged.description]
    staged.write_segments(lambda mv: parts.append(bytes(mv)), staged.segments)
    return b"".join(parts)
