"""A DTensor on a 0-dimensional mesh (torch's ``DeviceMesh("cpu", 1)``: one rank, no
placements) crosses the checkpoint format as the reference's does (issue 43)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tests.checkpointing.test_dtensor import _dt
from tests.checkpointing.test_serialization import _doc, _frame, _tensor
from torchheal.checkpointing import CheckpointError
from torchheal.checkpointing.deserialization import decode_bytes
from torchheal.checkpointing.serialization import encode_bytes


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_zero_dimensional_mesh_round_trip(world_of_one: None) -> None:
    mesh = DeviceMesh("cpu", torch.tensor(0), _init_backend=False)
    sent = DTensor.from_local(torch.arange(6.0).reshape(2, 3), mesh, [], run_check=False)
    got = decode_bytes(encode_bytes({"w": sent}, 1))["w"]
    assert isinstance(got, DTensor)
    assert got.device_mesh.mesh.tolist() == 0
    assert got.placements == ()
    assert torch.equal(got.to_local(), torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize(
    "dt",
    [
        _dt(mesh=0),  # one rank, but a placement for a dimension it does not have
        _dt(mesh=-1, placements=[]),
        _dt(mesh=True, placements=[]),
        _dt(mesh=None, placements=[]),
    ],
    ids=str,
)
def test_bad_zero_dimensional_meshes_are_refused(dt: Any) -> None:
    data = torch.arange(4.0).numpy().tobytes()
    storages = [{"nbytes": len(data), "crc": [zlib.crc32(data)]}]
    raw = _frame(_doc(storages=storages, tensors=_tensor(dtensor=dt))) + data
    with pytest.raises(CheckpointError, match=r"invalid checkpoint description: tensors\[0\]"):
        decode_bytes(raw)
