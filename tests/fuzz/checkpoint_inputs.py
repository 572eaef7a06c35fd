"""Hostile checkpoint streams: a real encoded state, then its header, description or data spoiled.

The base stream is what ``stage`` makes of a small state with nested containers, plain values,
a storage shared by two tensors and storages spanning several 4 KiB checksum blocks. Mutations:

* header: another magic, a description length too large or off by a few, a wrong CRC;
* description, as JSON: one field set to a hostile value (negative, 2**62 and beyond, NaN,
  another type, deep nesting, a huge list) or deleted, or a targeted lie (a storage size that
  does not match its data, a CRC list of the wrong length, a dtype outside the allowlist, a
  shape of 2**62 elements or 65 dimensions, a negative stride, a view past its storage, a
  storage index out of range, a tree 200 levels deep, an unknown node kind, a device or dtype
  torch does not know, a DTensor entry that lies) with the header re-stamped so the
  description's checksum passes and its content is what gets tested;
* description, as text: cut short, a number of 5,000 digits, nesting 100,000 deep, NaN;
* data: a flipped byte, cut short, extra bytes;
* garbage.

Each stream is judged by the in-memory decoder (``decode_bytes``) first: a receiving transport
must agree with it (refuse what it refuses with ``CheckpointError``, load what it loads).
"""

from __future__ import annotations

import copy
import functools
import json
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from torchheal.checkpointing.serialization import HEADER, MAGIC, encode_bytes

BLOCK = 4096
STEP = 7


def base_state() -> dict[str, Any]:
    """The honest state every hostile stream starts from."""
    w = torch.arange(3000, dtype=torch.float32)  # 12 KB: 3 blocks
    return {
        "model": {"w": w, "b": torch.ones(16), "tied": w[10:20]},
        "big": torch.arange(300_000, dtype=torch.int32),  # > 1 MiB: its own PG message
        "opt": [{"step": 3, "lr": 0.1, "betas": (0.9, 0.999)}, None],
        "name": "fuzz",
        "flags": torch.tensor([True, False]),
    }


@functools.cache
def base_stream() -> bytes:
    """The honest stream (header, description, data)."""
    return encode_bytes(base_state(), STEP, block_bytes=BLOCK)


def split(stream: bytes) -> tuple[bytes, bytes, bytes]:
    """(header, description, data) of a well-framed stream."""
    _, length, _ = HEADER.unpack(stream[: HEADER.size])
    end = HEADER.size + length
    return stream[: HEADER.size], stream[HEADER.size : end], stream[end:]


def frame(description: bytes, data: bytes) -> bytes:
    """A stream with a correct header for ``description``."""
    return HEADER.pack(MAGIC, len(description), zlib.crc32(description)) + description + data


@dataclass(frozen=True, repr=False)
class HostileStream:
    """One spoiled stream.

    Args:
        kind: what was spoiled, for reports.
        stream: the bytes a sender serves or sends.
    """

    kind: str
    stream: bytes

    def __repr__(self) -> str:
        return f"HostileStream({self.kind}, {len(self.stream)}B)"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # hypothesis would print every field (megabytes) otherwise


HOSTILE_JSON: list[Any] = [
    -1,
    0,
    1 << 62,
    1 << 63,
    1 << 64,
    -(1 << 70),
    1e308,
    float("nan"),
    float("inf"),
    "x",
    "",
    None,
    True,
    [],
    {},
    [0] * 10_000,
    [[[[[[[[[[[]]]]]]]]]]],
    {"t": "tensor", "i": 0},
]


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside a JSON document (dict keys and list indices)."""
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:8]):  # the first items of long lists are enough
            out += _paths(v, (*prefix, i))
    return out


@functools.cache
def _doc_and_paths() -> tuple[dict[str, Any], tuple[tuple[Any, ...], ...]]:
    _, desc, _ = split(base_stream())
    doc = json.loads(desc)
    return doc, tuple(_paths(doc))


def _set(doc: Any, path: tuple[Any, ...], value: Any, delete: bool = False) -> None:
    for key in path[:-1]:
        doc = doc[key]
    if delete:
        del doc[path[-1]]
    else:
        doc[path[-1]] = value


def _deep(kind: str, depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"t": "none"}
    for _ in range(depth):
        node = {"t": kind, "v": [node]}
    return node


def _targeted() -> list[tuple[str, Any]]:
    """(what, edit) lies a crafted sender would tell; ``edit(doc)`` changes it in place."""
    lies: list[tuple[str, Any]] = []

    def lie(name: str):
        def register(fn: Any) -> Any:
            lies.append((name, fn))
            return fn

        return register

    for n in (-1, 0, 1, 4095, 4097, 1 << 40, 1 << 62):
        lies.append((f"storage nbytes {n}", lambda d, n=n: d["storages"][0].update(nbytes=n)))
    lies.append(("crc list too short", lambda d: d["storages"][0]["crc"].pop()))
    lies.append(("crc list too long", lambda d: d["storages"][0]["crc"].append(0)))
    lies.append(("crc not an int", lambda d: d["storages"][0]["crc"].__setitem__(0, "0")))
    lies.append(("crc negative", lambda d: d["storages"][0]["crc"].__setitem__(0, -1)))
    for dtype in ("object", "float128", "torch.float32", "complex32", "bool", "qint8", "", 7):
        lies.append((f"dtype {dtype!r}", lambda d, v=dtype: d["tensors"][0].update(dtype=v)))
    for shape in ([1 << 62], [-1], [0], [1] * 65, [3000, 3000], [], [1 << 31, 1 << 31]):
        lies.append((f"shape {shape[:3]}", lambda d, v=shape: d["tensors"][0].update(shape=v)))
    for stride in ([-1], [1 << 62], [0], [1, 1]):
        lies.append((f"stride {stride}", lambda d, v=stride: d["tensors"][0].update(stride=v)))
    for offset in (-1, 2999, 3000, 1 << 62):
        lies.append((f"offset {offset}", lambda d, v=offset: d["tensors"][0].update(offset=v)))
    for s in (-1, 99, 1 << 62):
        lies.append((f"storage index {s}", lambda d, v=s: d["tensors"][0].update(s=v)))
    for block in (0, 1, 4095, 1 << 40, -4096):
        lies.append((f"block {block}", lambda d, v=block: d.update(block=v)))
    lies.append(("step mismatch", lambda d: d.update(step=STEP + 1)))
    lies.append(("format", lambda d: d.update(format="pickle")))
    lies.append(("version", lambda d: d.update(version=2)))
    lies.append(("tree 200 deep", lambda d: d.update(tree=_deep("list", 200))))
    lies.append(("tree 99 deep", lambda d: d.update(tree=_deep("list", 99))))
    for node in (
        {"t": "pickle", "v": "gASVCAAAAAAAAACMBHRlc3SULg=="},
        {"t": "tensor", "i": 99},
        {"t": "tensor", "i": -1},
        {"t": "bytes", "v": "abc"},
        {"t": "float", "v": "1.0"},
        {"t": "float", "v": "nan"},
        {"t": "device", "v": "cuda:99"},
        {"t": "device", "v": "not a device"},
        {"t": "device", "v": "meta"},
        {"t": "size", "v": [-1]},
        {"t": "dtype", "v": "object"},
        {"t": "dict", "k": [{"t": "tensor", "i": 0}], "v": [{"t": "none"}]},
        {"t": "dict", "k": [{"t": "list", "v": []}], "v": [{"t": "none"}]},
        {"t": "odict", "k": [], "v": [{"t": "none"}]},
        {"t": "int", "v": 1.5},
        {"t": "str", "v": 5},
        {"t": 5},
        [],
    ):
        lies.append((f"tree node {json.dumps(node)[:40]}", lambda d, v=node: d.update(tree=v)))
    for dt in (
        {
            "device_type": "cpu",
            "mesh": [0, 1],
            "placements": [["shard", 0]],
            "shape": [6000],
            "stride": [1],
        },
        {
            "device_type": "evil",
            "mesh": [0],
            "placements": [["replicate"]],
            "shape": [3000],
            "stride": [1],
        },
        {
            "device_type": "cpu",
            "mesh": [[0, 1], [2]],
            "placements": [],
            "shape": [3000],
            "stride": [1],
        },
        {
            "device_type": "cpu",
            "mesh": [0, 0],
            "placements": [["shard", 0]],
            "shape": [3000],
            "stride": [1],
        },
        {
            "device_type": "cpu",
            "mesh": [0],
            "placements": [["shard", 9]],
            "shape": [3000],
            "stride": [1],
        },
        "not a dict",
    ):
        lies.append((f"dtensor {str(dt)[:40]}", lambda d, v=dt: d["tensors"][0].update(dtensor=v)))
    return lies


TARGETED = _targeted()


def _text_mutations(desc: bytes) -> list[tuple[str, bytes]]:
    return [
        ("description cut short", desc[: len(desc) // 2]),
        ("description empty", b""),
        ("description 5000-digit number", desc.replace(b'"step":7', b'"step":' + b"7" * 5000)),
        ("description nested 100000 deep", b"[" * 100_000),
        ("description NaN step", desc.replace(b'"step":7', b'"step":NaN')),
        ("description not UTF-8", desc.replace(b"fuzz", b"\xff\xfe\xfd\xfc")),
        ("description BOM", b"\xef\xbb\xbf" + desc),
        ("description duplicate keys", desc.replace(b'{"format"', b'{"step":-5,"format"', 1)),
        ("description a list", b"[]"),
    ]


@st.composite
def hostile_streams(draw: st.DrawFn) -> HostileStream:
    """One spoiled stream (see the module docstring)."""
    header, desc, data = split(base_stream())
    family = draw(st.sampled_from(["json"] * 4 + ["targeted"] * 4 + ["text", "header", "data"]))
    if family == "json":
        doc, paths = _doc_and_paths()
        doc = copy.deepcopy(doc)
        path = draw(st.sampled_from(paths))
        if draw(st.integers(0, 5)) == 0:
            _set(doc, path, None, delete=True)
            kind = f"deleted {'.'.join(map(str, path))}"
        else:
            value = draw(st.sampled_from(HOSTILE_JSON))
            _set(doc, path, value)
            kind = f"{'.'.join(map(str, path))} = {json.dumps(value)[:30]}"
        return HostileStream(kind, frame(json.dumps(doc).encode(), data))
    if family == "targeted":
        doc = copy.deepcopy(_doc_and_paths()[0])
        name, edit = draw(st.sampled_from(TARGETED))
        edit(doc)
        return HostileStream(name, frame(json.dumps(doc).encode(), data))
    if family == "text":
        name, text = draw(st.sampled_from(_text_mutations(desc)))
        return HostileStream(name, frame(text, data))
    if family == "header":
        _, length, crc = HEADER.unpack(header)
        name, spoiled = draw(
            st.sampled_from(
                [
                    ("magic", HEADER.pack(b"PICKLE01", length, crc)),
                    ("length huge", HEADER.pack(MAGIC, (1 << 64) - 1, crc)),
                    ("length past the limit", HEADER.pack(MAGIC, (256 << 20) + 1, crc)),
                    ("length short by 1", HEADER.pack(MAGIC, length - 1, crc)),
                    ("length long by 1", HEADER.pack(MAGIC, length + 1, crc)),
                    ("crc", HEADER.pack(MAGIC, length, crc ^ 1)),
                    ("header cut", header[:10]),
                ]
            )
        )
        return HostileStream(f"header {name}", spoiled + desc + data)
    # Data.
    where = draw(st.integers(0, len(data) - 1))
    name = draw(st.sampled_from(["flip", "cut", "extra", "garbage"]))
    if name == "flip":
        spoiled = bytearray(data)
        spoiled[where] ^= 1 << draw(st.integers(0, 7))
        return HostileStream(f"data byte {where} flipped", header + desc + bytes(spoiled))
    if name == "cut":
        return HostileStream(f"data cut at {where}", header + desc + data[:where])
    if name == "extra":
        return HostileStream("data with extra bytes", header + desc + data + b"\x00" * 100)
    return HostileStream("garbage", draw(st.binary(max_size=300)))


KNOWN_LIES = (
    "storage nbytes 4097",
    "step mismatch",
    "shape [3000, 3000]",
    'tree node {"t": "device", "v": "not a device"}',
    'tree node {"t": "pickle"',
    "tree 200 deep",
    "dtype 'object'",
)


def known_streams() -> list[HostileStream]:
    """Hand-picked spoiled streams every receiver must refuse (sent before generated ones).

    Among them a flipped byte in each storage's last block: a receiver filling live tensors in
    place would have written every earlier block of that storage before the flip shows.
    """
    header, desc, data = split(base_stream())
    doc = json.loads(desc)
    out = []
    start = 0
    for i, storage in enumerate(doc["storages"]):
        end = start + storage["nbytes"]
        if end > start:
            spoiled = bytearray(data)
            spoiled[end - 1] ^= 0x01
            out.append(HostileStream(f"storage {i}: last byte flipped", header + desc + spoiled))
        start = end
    out.append(HostileStream("data cut in the last block", header + desc + data[:-3]))
    wrong_crc = HEADER.pack(MAGIC, len(desc), zlib.crc32(desc) ^ 1)
    out.append(HostileStream("description CRC", wrong_crc + desc + data))
    for name, edit in TARGETED:
        if name.startswith(KNOWN_LIES):
            doc = json.loads(desc)
            edit(doc)
            out.append(HostileStream(name, frame(json.dumps(doc).encode(), data)))
    return out
