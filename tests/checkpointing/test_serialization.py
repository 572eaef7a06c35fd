"""Pickle-free checkpoint format: round trips, integrity checks and hostile descriptions."""

import json
import pickle
import struct
import zlib
from collections import OrderedDict
from typing import Any

import pytest
import torch

from torchheal.checkpointing import CheckpointError
from torchheal.checkpointing.serialization import (
    HEADER,
    decode_bytes,
    encode_bytes,
    split_chunks,
    stage,
)

BLOCK = 4096


def assert_same(a: Any, b: Any) -> None:
    """Deep equality with exact tensor dtype/shape/stride/values and container types."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


def sample_state() -> dict[str, Any]:
    base = torch.arange(48, dtype=torch.float32).view(6, 8)
    return {
        "model": OrderedDict(
            weight=torch.randn(33, 17),
            bias=torch.randn(17, dtype=torch.float64),
            half=torch.randn(5, dtype=torch.bfloat16),
            fp16=torch.randn(4, dtype=torch.float16),
            mask=torch.tensor([True, False, True]),
            ints=torch.arange(7, dtype=torch.int64),
            bytes_=torch.arange(9, dtype=torch.uint8),
            cplx=torch.randn(3, dtype=torch.complex64),
        ),
        "views": {"t": base.t(), "slice": base[1:4, 2:7:2], "full": base},
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "name": None}],
        },
        "plain": [1, -(2**70), 1.5, float("inf"), float("nan"), True, "héllo", b"\x00\xff", None],
        "types": {
            "dtype": torch.bfloat16,
            "device": torch.device("cpu"),
            "size": torch.Size([2, 3]),
        },
        "tuple": (1, (2, 3)),
    }


def test_round_trip_nested_dtypes_views_empty_scalars() -> None:
    state = sample_state()
    out = decode_bytes(encode_bytes(state, 7, block_bytes=BLOCK))
    assert_same(state, out)


def test_shared_storage_is_sent_once_and_stays_shared() -> None:
    w = torch.randn(1000)
    state = {"a": w, "tied": w, "view": w[10:20]}
    staged = stage(state, 1, block_bytes=BLOCK)
    assert len(staged.buffers) == 1 and staged.data_bytes == w.numel() * 4
    out = decode_bytes(encode_bytes(state, 1, block_bytes=BLOCK))
    assert out["a"].untyped_storage().data_ptr() == out["view"].untyped_storage().data_ptr()
    assert torch.equal(out["view"], w[10:20])


def test_conj_view_is_materialised() -> None:
    z = torch.randn(4, dtype=torch.complex64)
    out = decode_bytes(encode_bytes({"z": z.conj()}, 0))
    assert torch.equal(out["z"], z.conj().resolve_conj())


def test_in_place_template_keeps_storage() -> None:
    from torchheal.checkpointing.deserialization import (
        allocate_buffers,
        parse_description,
        read_segments,
        rebuild,
    )

    src = {"w": torch.randn(64, 3), "n": 3}
    template = {"w": torch.zeros(64, 3), "n": 0}
    staged = stage(src, 4, block_bytes=BLOCK)
    desc = parse_description(staged.description)
    buffers, used = allocate_buffers(desc, template)
    stream = bytearray()
    staged.write_segments(stream.extend, staged.segments)
    view, pos = memoryview(stream), 0

    def readinto(out: memoryview) -> int:
        nonlocal pos
        n = min(len(out), len(view) - pos)
        out[:n] = view[pos : pos + n]
        pos += n
        return n

    read_segments(readinto, buffers, desc.segments)
    out = rebuild(desc, buffers, used)
    assert out["w"] is template["w"] and torch.equal(template["w"], src["w"]) and out["n"] == 3


def test_unrepresentable_value_names_key_path() -> None:
    with pytest.raises(CheckpointError, match=r"builtins.object at state\['opt'\]\[1\]"):
        stage({"opt": [1, object()]}, 0)
    with pytest.raises(CheckpointError, match=r"sparse|layout"):
        stage({"s": torch.eye(3).to_sparse()}, 0)


def _corrupt(data: bytes, index: int) -> bytes:
    b = bytearray(data)
    b[index] ^= 0x01
    return bytes(b)


def test_corrupted_tensor_bytes_detected() -> None:
    data = encode_bytes({"w": torch.randn(5000)}, 1, block_bytes=BLOCK)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        decode_bytes(_corrupt(data, len(data) - 100))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        decode_bytes(_corrupt(data, HEADER.size + 3))  # inside the description


def test_truncated_and_trailing_streams_detected() -> None:
    data = encode_bytes({"w": torch.randn(5000)}, 1, block_bytes=BLOCK)
    for cut in (3, HEADER.size + 5, len(data) - 1):
        with pytest.raises(CheckpointError, match=r"truncated|data bytes"):
            decode_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="data bytes"):
        decode_bytes(data + b"x")


def _frame(doc: Any) -> bytes:
    desc = json.dumps(doc).encode() if not isinstance(doc, bytes) else doc
    return HEADER.pack(b"THCKPT01", len(desc), zlib.crc32(desc)) + desc


def _doc(**overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": "torchheal.checkpoint",
        "version": 1,
        "step": 1,
        "block": BLOCK,
        "storages": [{"nbytes": 16, "crc": [zlib.crc32(bytes(16))]}],
        "tensors": [{"s": 0, "dtype": "float32", "shape": [4], "stride": [1], "offset": 0}],
        "tree": {"t": "tensor", "i": 0},
    }
    doc.update(overrides)
    return doc


def _tensor(**kw: Any) -> list[dict[str, Any]]:
    t = {"s": 0, "dtype": "float32", "shape": [4], "stride": [1], "offset": 0}
    t.update(kw)
    return [t]


def test_well_formed_handmade_description_decodes() -> None:
    out = decode_bytes(_frame(_doc()) + bytes(16))
    assert torch.equal(out, torch.zeros(4))


@pytest.mark.parametrize(
    "doc",
    [
        _doc(tensors=_tensor(dtype="object")),
        _doc(tensors=_tensor(dtype="torch.float32")),
        _doc(tensors=_tensor(shape=[-4], stride=[1])),
        _doc(tensors=_tensor(shape=[2**40, 2**40], stride=[1, 1])),
        _doc(tensors=_tensor(shape=[4], stride=[-1])),
        _doc(tensors=_tensor(offset=-1)),
        _doc(tensors=_tensor(offset=1)),  # runs past the storage
        _doc(tensors=_tensor(s=5)),
        _doc(tensors=_tensor(shape=[1] * 100, stride=[1] * 100)),
        _doc(storages=[{"nbytes": -16, "crc": []}]),
        _doc(storages=[{"nbytes": 16, "crc": []}]),
        _doc(storages=[{"nbytes": 16, "crc": [2**40]}]),
        _doc(tree={"t": "tensor", "i": 3}),
        _doc(tree={"t": "object", "v": "os.system"}),
        _doc(tree={"t": "dict", "k": [{"t": "tensor", "i": 0}], "v": [{"t": "none"}]}),
        _doc(tree={"t": "int", "v": "1"}),
        _doc(step="1"),
        _doc(version=2),
        _doc(block=1),
    ],
)
def test_malicious_description_rejected(doc: dict[str, Any]) -> None:
    with pytest.raises(CheckpointError, match=r"invalid|not a torchheal"):
        decode_bytes(_frame(doc) + bytes(16))


def test_pickle_and_deep_json_rejected_without_executing() -> None:
    class Boom:
        def __reduce__(self) -> Any:
            return (pytest.fail, ("pickle was executed",))

    payload = pickle.dumps({"x": Boom()})
    with pytest.raises(CheckpointError, match="not valid JSON"):
        decode_bytes(_frame(payload))
    with pytest.raises(CheckpointError, match="not a torchheal"):
        decode_bytes(payload + bytes(HEADER.size))  # raw pickle: wrong magic
    deep = b"[" * 100000 + b"]" * 100000
    with pytest.raises(CheckpointError):
        decode_bytes(_frame(deep))
    nested: dict[str, Any] = {"t": "none"}
    for _ in range(200):
        nested = {"t": "list", "v": [nested]}
    with pytest.raises(CheckpointError, match="deeper"):
        decode_bytes(_frame(_doc(storages=[], tensors=[], tree=nested)))


def test_absurd_description_length_rejected() -> None:
    with pytest.raises(CheckpointError, match="too large"):
        decode_bytes(struct.pack("<8sQI", b"THCKPT01", 2**60, 0))


def test_split_chunks_balanced_and_complete() -> None:
    staged = stage({"a": torch.zeros(10 * BLOCK // 4), "b": torch.zeros(3)}, 0, block_bytes=BLOCK)
    for n in (1, 3, 7, 20):
        chunks = split_chunks(staged.segments, n)
        assert len(chunks) == n
        assert [s for c in chunks for s in c] == list(staged.segments)
        sizes = [sum(s.end - s.start for s in c) for c in chunks]
        assert max(sizes) - min(sizes) <= 2 * BLOCK or n > len(staged.segments)
