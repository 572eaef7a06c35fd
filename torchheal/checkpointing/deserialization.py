"""Receiving side of the pickle-free checkpoint format: parse, validate, read, verify, rebuild.

The JSON description is validated in full before a byte of tensor data is accepted, and every
block is checked against its CRC-32 before the state is rebuilt; a template's own storages only
ever get verified bytes. Any problem raises ``CheckpointError`` and nothing is returned.
"""

from __future__ import annotations

import json
import math
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchheal.checkpointing._dtensor import parse_dtensor, rebuild_dtensor
from torchheal.checkpointing._format import (
    DTYPES,
    FORMAT,
    HEADER,
    MAGIC,
    MAX_DEPTH,
    MAX_DESCRIPTION_BYTES,
    MAX_DIMS,
    VERSION,
    Segment,
    byte_view,
    crc32,
    segments_of,
    storage_bytes,
)
from torchheal.checkpointing.transport import CheckpointError
from torchheal.utils import dtensor_type


@dataclass(frozen=True)
class TensorSpec:
    """A validated tensor entry of a received description."""

    storage: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtensor: Mapping[str, Any] | None


@dataclass(frozen=True)
class Description:
    """A received description, parsed and fully validated (see ``parse_description``).

    ``segments``: every block of every storage in stream order, with its expected CRC.
    """

    step: int
    block_bytes: int
    storage_nbytes: tuple[int, ...]
    tensors: tuple[TensorSpec, ...]
    tree: Any
    segments: tuple[Segment, ...]

    @property
    def data_bytes(self) -> int:
        """Total bytes of tensor data that follow the description."""
        return sum(self.storage_nbytes)


def parse_header(data: bytes) -> tuple[int, int]:
    """Checks a frame header; returns (description length, description CRC)."""
    if len(data) != HEADER.size:
        raise CheckpointError(f"truncated checkpoint header: {len(data)} of {HEADER.size} bytes")
    magic, length, crc = HEADER.unpack(data)
    if magic != MAGIC:
        raise CheckpointError(f"not a torchheal checkpoint stream (magic {magic!r})")
    if length > MAX_DESCRIPTION_BYTES:
        raise CheckpointError(f"checkpoint description too large: {length} bytes")
    return length, crc


def _int(value: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise CheckpointError(f"invalid checkpoint description: {what} = {value!r}")
    return value


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) > MAX_DIMS:
        raise CheckpointError(f"invalid checkpoint description: {what} = {value!r}")
    return tuple(_int(v, what) for v in value)


def parse_description(data: bytes, crc: int | None = None) -> Description:
    """Parses and validates a received description; ``crc`` (the header's) is checked if given."""
    if crc is not None and zlib.crc32(data) != crc:
        raise CheckpointError("checkpoint description checksum mismatch (corrupted transfer)")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"checkpoint description is not valid JSON: {e}") from None
    if type(doc) is not dict or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise CheckpointError("not a torchheal checkpoint description (format/version)")
    step = _int(doc.get("step"), "step", -(1 << 62))
    block = _int(doc.get("block"), "block", 4096, 1 << 34)
    raw_storages = doc.get("storages")
    raw_tensors = doc.get("tensors")
    if type(raw_storages) is not list or type(raw_tensors) is not list:
        raise CheckpointError("invalid checkpoint description: storages/tensors must be lists")
    nbytes: list[int] = []
    for i, s in enumerate(raw_storages):
        if type(s) is not dict:
            raise CheckpointError(f"invalid checkpoint description: storage {i}")
        n = _int(s.get("nbytes"), f"storages[{i}].nbytes")
        crcs = s.get("crc")
        if type(crcs) is not list or len(crcs) != math.ceil(n / block):
            raise CheckpointError(f"invalid checkpoint description: storages[{i}].crc")
        for c in crcs:
            _int(c, f"storages[{i}].crc", 0, 0xFFFFFFFF)
        nbytes.append(n)
    tensors = tuple(_parse_tensor(i, t, nbytes) for i, t in enumerate(raw_tensors))
    tree = doc.get("tree")
    _decode(tree, lambda i: _int(i, "tensor index", 0, len(tensors) - 1), 0)
    return Description(
        step=step,
        block_bytes=block,
        storage_nbytes=tuple(nbytes),
        tensors=tensors,
        tree=tree,
        segments=tuple(segments_of(raw_storages, block)),
    )


def _parse_tensor(i: int, t: Any, nbytes: Sequence[int]) -> TensorSpec:
    what = f"tensors[{i}]"
    if type(t) is not dict:
        raise CheckpointError(f"invalid checkpoint description: {what}")
    s = _int(t.get("s"), f"{what}.s", 0, len(nbytes) - 1)
    dtype = DTYPES.get(t.get("dtype")) if type(t.get("dtype")) is str else None
    if dtype is None:
        raise CheckpointError(f"invalid checkpoint description: {what}.dtype = {t.get('dtype')!r}")
    shape = _int_list(t.get("shape"), f"{what}.shape")
    stride = _int_list(t.get("stride"), f"{what}.stride")
    offset = _int(t.get("offset"), f"{what}.offset")
    if len(shape) != len(stride):
        raise CheckpointError(f"invalid checkpoint description: {what} shape/stride rank differ")
    itemsize = dtype.itemsize
    if nbytes[s] % itemsize:
        raise CheckpointError(f"invalid checkpoint description: {what} storage not {dtype}-aligned")
    if all(shape):  # non-empty: the furthest element must lie inside the storage
        last = offset + sum((d - 1) * st for d, st in zip(shape, stride, strict=True))
        if (last + 1) * itemsize > nbytes[s]:
            raise CheckpointError(
                f"invalid checkpoint description: {what} view {list(shape)} exceeds its storage"
            )
    dt = t.get("dtensor")
    spec = None if dt is None else parse_dtensor(f"{what}.dtensor", dt)
    return TensorSpec(s, dtype, shape, stride, offset, spec)


def _decode(node: Any, tensor: Callable[[Any], Any], depth: int) -> Any:
    """Rebuilds a value from its JSON node; ``tensor`` maps a tensor index to the value."""
    if depth > MAX_DEPTH:
        raise CheckpointError(f"checkpoint tree nested deeper than {MAX_DEPTH}")
    if type(node) is not dict or type(node.get("t")) is not str:
        raise CheckpointError(f"invalid checkpoint tree node: {str(node)[:80]}")
    kind, v = node["t"], node.get("v")
    try:
        if kind == "tensor":
            return tensor(node.get("i"))
        if kind in ("dict", "odict"):
            keys = node.get("k")
            if type(keys) is not list or type(v) is not list or len(keys) != len(v):
                raise CheckpointError("invalid checkpoint tree: dict keys/values")
            items = [
                (_decode(k, _no_tensor, depth + 1), _decode(x, tensor, depth + 1))
                for k, x in zip(keys, v, strict=True)
            ]
            return OrderedDict(items) if kind == "odict" else dict(items)
        if kind in ("list", "tuple"):
            if type(v) is not list:
                raise CheckpointError(f"invalid checkpoint tree: {kind} values")
            out = [_decode(x, tensor, depth + 1) for x in v]
            return out if kind == "list" else tuple(out)
        return _PLAIN[kind](v)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError, RuntimeError) as e:
        # RuntimeError: torch.device() refusing a device string.
        raise CheckpointError(f"invalid checkpoint tree node of kind {kind!r}: {e}") from None


def _no_tensor(_: Any) -> Any:
    raise CheckpointError("invalid checkpoint tree: tensor used as a dict key")


def _typed(kind: type, convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def parse(v: Any) -> Any:
        if type(v) is not kind:
            raise TypeError(f"expected {kind.__name__}, got {type(v).__name__}")
        return convert(v)

    return parse


def _dtype(v: Any) -> torch.dtype:
    if type(v) is not str or v not in DTYPES:
        raise ValueError(f"unknown dtype {v!r}")
    return DTYPES[v]


_PLAIN: dict[str, Callable[[Any], Any]] = {
    "none": lambda v: None,
    "bool": _typed(bool, bool),
    "int": _typed(int, int),
    "float": _typed(str, float.fromhex),
    "str": _typed(str, str),
    "bytes": _typed(str, bytes.fromhex),
    "dtype": _dtype,
    "device": _typed(str, torch.device),
    "size": lambda v: torch.Size(_int_list(v, "size")),
}


def _match_templates(desc: Description, template: Any) -> dict[int, torch.Tensor]:
    """Finds, for each tensor index, the template tensor at the same key path (if any)."""
    found: dict[int, torch.Tensor] = {}

    def walk(node: Any, tmpl: Any) -> None:
        kind = node["t"]
        if kind == "tensor":
            if isinstance(tmpl, torch.Tensor):
                found[node["i"]] = tmpl
        elif kind in ("dict", "odict") and isinstance(tmpl, Mapping):
            for k, v in zip(node["k"], node["v"], strict=True):
                key = _decode(k, _no_tensor, 0)
                try:
                    if key in tmpl:
                        walk(v, tmpl[key])
                except TypeError:  # unhashable key
                    continue
        elif kind in ("list", "tuple") and isinstance(tmpl, list | tuple):
            for v, t in zip(node["v"], tmpl, strict=False):
                walk(v, t)

    walk(desc.tree, template)
    return found


def allocate_buffers(
    desc: Description, template: Any = None, device: torch.device | str = "cpu"
) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """Allocates one receive buffer per storage, reusing template storages where they fit.

    A template tensor at the same key path is used when its dtype, device and storage size
    match. Such a buffer is the caller's live tensor: write only verified bytes into it.
    Returns (buffers, templates used by tensor index).
    """
    buffers: list[torch.Tensor | None] = [None] * len(desc.storage_nbytes)
    used: dict[int, torch.Tensor] = {}
    if template is not None:
        dtensor = dtensor_type()
        taken: set[int] = set()  # template storages already written by another storage
        for i, t in _match_templates(desc, template).items():
            spec = desc.tensors[i]
            local = t.to_local() if dtensor is not None and isinstance(t, dtensor) else t
            ptr = local.untyped_storage().data_ptr()
            if (
                buffers[spec.storage] is None
                and ptr not in taken
                and local.dtype == spec.dtype
                and local.untyped_storage().nbytes() == desc.storage_nbytes[spec.storage]
                and local.device.type == torch.device(device).type
                and not (local.is_conj() or local.is_neg())
            ):
                buffers[spec.storage] = storage_bytes(local)
                taken.add(ptr)
                used[i] = t
            elif (
                buffers[spec.storage] is not None
                and ptr == buffers[spec.storage].data_ptr()
                and local.dtype == spec.dtype
            ):
                used[i] = t  # another view of a storage already received in place
    try:
        out = [
            b if b is not None else torch.empty(n, dtype=torch.uint8, device=device)
            for b, n in zip(buffers, desc.storage_nbytes, strict=True)
        ]
    except RuntimeError as e:  # absurd sizes that passed validation, or a real OOM
        raise CheckpointError(f"cannot allocate {desc.data_bytes} bytes for checkpoint: {e}") from e
    return out, used


def verify_segment(view: memoryview, seg: Segment) -> None:
    """Checks a received block against its CRC; raises ``CheckpointError`` if it differs."""
    if crc32(view[seg.start : seg.end]) != seg.crc:
        raise _mismatch(seg)


def _mismatch(seg: Segment) -> CheckpointError:
    return CheckpointError(
        f"checkpoint checksum mismatch in storage {seg.storage} bytes [{seg.start}, {seg.end}) "
        "(corrupted transfer)"
    )


#: Bytes read per call by :func:`read_segments`: small enough to be still in cache when their
#: CRC-32 is computed right after.
READ_SLICE_BYTES = 1 << 20


def read_segments(
    readinto: Callable[[memoryview], int],
    buffers: Sequence[torch.Tensor],
    segments: Sequence[Segment],
    verify: Callable[[memoryview, Segment], None] | None = None,
) -> None:
    """Reads ``segments`` from a stream straight into ``buffers`` (CPU), verifying each.

    ``readinto`` returning 0 means end of stream. Without ``verify``, each block's CRC-32 is
    computed slice by slice as it arrives, while the bytes are still in cache.
    """
    views = [byte_view(b) for b in buffers]
    for seg in segments:
        view = views[seg.storage]
        pos, crc = seg.start, 0
        while pos < seg.end:
            n = readinto(view[pos : min(seg.end, pos + READ_SLICE_BYTES)])
            if not n:
                raise CheckpointError(
                    f"truncated checkpoint stream: storage {seg.storage} ended at byte {pos} "
                    f"of block [{seg.start}, {seg.end})"
                )
            if verify is None:
                crc = crc32(view[pos : pos + n], crc)
            pos += n
        if verify is not None:
            verify(view, seg)
        elif crc != seg.crc:
            raise _mismatch(seg)


def rebuild(
    desc: Description, buffers: Sequence[torch.Tensor], used: Mapping[int, torch.Tensor]
) -> Any:
    """Rebuilds the state dict from verified buffers.

    Template tensors received in place with the same shape/stride/offset are returned as is.
    """

    def tensor(i: int) -> torch.Tensor:
        spec = desc.tensors[i]
        tmpl = used.get(i)
        if tmpl is not None:
            local = (
                tmpl.to_local() if spec.dtensor is not None and hasattr(tmpl, "to_local") else tmpl
            )
            if (
                tuple(local.shape) == spec.shape
                and tuple(local.stride()) == spec.stride
                and local.storage_offset() == spec.offset
            ):
                return tmpl
        flat = buffers[spec.storage]
        typed = (
            flat.view(spec.dtype)
            if flat.numel()
            else torch.empty(0, dtype=spec.dtype, device=flat.device)
        )
        out = typed.as_strided(spec.shape, spec.stride, spec.offset)
        if spec.dtensor is not None:
            out = rebuild_dtensor(out, spec.dtensor)
        return out

    return _decode(desc.tree, tensor, 0)


def decode_bytes(data: bytes | memoryview, template: Any = None) -> Any:
    """Decodes a whole framed checkpoint held in memory, optionally into ``template``."""
    view = memoryview(data).cast("B")
    length, crc = parse_header(bytes(view[: HEADER.size]))
    end = HEADER.size + length
    if len(view) < end:
        raise CheckpointError("truncated checkpoint stream: description cut short")
    desc = parse_description(bytes(view[HEADER.size : end]), crc)
    if len(view) - end != desc.data_bytes:
        raise CheckpointError(
            f"checkpoint stream has {len(view) - end} data bytes, description says {desc.data_bytes}"
        )
    # Every block is checked where it lies before any is copied: a template's tensors are
    # the caller's live state and must never hold unverified bytes.
    pos = end
    for seg in desc.segments:
        base = pos - seg.start  # where the segment's storage would begin in the stream
        verify_segment(view[base : base + seg.end], seg)
        pos += seg.end - seg.start
    buffers, used = allocate_buffers(desc, template)
    pos = end

    def readinto(out: memoryview) -> int:
        nonlocal pos
        n = min(len(out), len(view) - pos)
        out[:n] = view[pos : pos + n]
        pos += n
        return n

    read_segments(readinto, buffers, desc.segments, verify=_verified)
    return rebuild(desc, buffers, used)


def _verified(view: memoryview, seg: Segment) -> None:
    """``read_segments``' check for blocks already verified in place."""
