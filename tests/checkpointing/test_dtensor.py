"""DTensors through the checkpoint wire format and both transports (hostile descriptions too).

The receiving rank is normally outside the sender's mesh (a healing replica group's ranks are
not its source's); it must still get the shard that was sent, not the empty local tensor a
rank outside a mesh sees.
"""

from __future__ import annotations

import queue
import zlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from tests import warm
from tests.checkpointing.test_serialization import _doc, _frame, _tensor
from torchheal.checkpointing import CheckpointError
from torchheal.checkpointing.deserialization import decode_bytes
from torchheal.checkpointing.serialization import encode_bytes

TIMEOUT = timedelta(seconds=30)


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _dtensor(placement: Any, ranks: list[int] | None = None) -> DTensor:
    mesh = DeviceMesh("cpu", torch.tensor(ranks or [0]), _init_backend=False)
    return DTensor.from_local(torch.arange(3.0), mesh, [placement], run_check=False)


@pytest.mark.parametrize("placement", [Shard(0), Replicate(), Partial("sum")], ids=str)
def test_round_trip_keeps_shard_mesh_and_placement(world_of_one: None, placement: Any) -> None:
    sent = _dtensor(placement)
    got = decode_bytes(encode_bytes({"w": sent, "step": 3}, 3))["w"]
    assert isinstance(got, DTensor)
    assert torch.equal(got.to_local(), torch.arange(3.0))
    assert got.placements == sent.placements
    assert got.device_mesh.mesh.tolist() == [0]
    assert got.shape == sent.shape and got.stride() == sent.stride()


def _description_with_mesh(ranks: list[int]) -> bytes:
    # A description as a peer whose mesh is ``ranks`` sends it; this process is not in it.
    dt = {
        "device_type": "cpu",
        "mesh": ranks,
        "dim_names": None,
        "placements": [["shard", 0]],
        "shape": [12],
        "stride": [1],
    }
    data = torch.arange(4.0).numpy().tobytes()
    storages = [{"nbytes": len(data), "crc": [zlib.crc32(data)]}]
    return _frame(_doc(storages=storages, tensors=_tensor(dtensor=dt))) + data


def test_a_receiver_outside_the_senders_mesh_keeps_the_shard(world_of_one: None) -> None:
    got = decode_bytes(_description_with_mesh([5]))
    assert isinstance(got, DTensor)
    assert got.to_local().shape == (4,)  # was [0] when rebuilt with DTensor.from_local
    assert torch.equal(got.to_local(), torch.arange(4.0))
    assert got.shape == (12,)


def _dt(**overrides: Any) -> dict[str, Any]:
    dt: dict[str, Any] = {
        "device_type": "cpu",
        "mesh": [0],
        "dim_names": None,
        "placements": [["shard", 0]],
        "shape": [4],
        "stride": [1],
    }
    dt.update(overrides)
    return dt


@pytest.mark.parametrize(
    "dt",
    [
        "cpu",
        _dt(device_type="load"),  # would reach torch as an attribute name
        _dt(device_type=["cpu"]),
        _dt(mesh="0"),
        _dt(mesh=[]),
        _dt(mesh=[[0, 1], [2]]),  # ragged
        _dt(mesh=[-1]),
        _dt(mesh=[0, 0]),
        _dt(mesh=[1.5]),
        _dt(mesh=[[[[0]]]] * 2),
        _dt(mesh=list(range(2_000_000))),
        _dt(placements=[]),
        _dt(placements=[["shard", 1]]),  # the global tensor has one dimension
        _dt(placements=[["shard", "0"]]),
        _dt(placements=[["partial", "__import__"]]),
        _dt(placements=[["scatter"]]),
        _dt(placements="shard"),
        _dt(shape=[4, 4], stride=[1]),
        _dt(shape=[-4]),
        _dt(dim_names=["a", "b"]),
        _dt(dim_names=[1]),
    ],
    ids=lambda d: str(d)[:60],
)
def test_hostile_dtensor_descriptions_are_rejected_before_torch_sees_them(dt: Any) -> None:
    with pytest.raises(CheckpointError, match=r"invalid checkpoint description: tensors\[0\]"):
        decode_bytes(_frame(_doc(tensors=_tensor(dtensor=dt))) + bytes(16))


# --- over both transports, across processes (the receiver is rank 1, outside mesh [0]) -----


def _rank(rank: int, port: int, transport: str, out: Any) -> None:
    from torchheal.checkpointing import HTTPTransport
    from torchheal.checkpointing.pg_transport import PGTransport

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    try:
        if transport == "pg":
            pg = dist.new_group(backend="gloo")
            carrier: Any = PGTransport(pg, timeout=TIMEOUT, device=torch.device("cpu"))
        else:
            carrier = HTTPTransport(timeout=TIMEOUT, num_chunks=0)
        if rank == 0:
            mesh = DeviceMesh("cpu", torch.tensor([0]), _init_backend=False)
            sent = DTensor.from_local(torch.arange(3.0), mesh, [Shard(0)], run_check=False)
            store.set("metadata", carrier.metadata())
            carrier.send_checkpoint([1], 7, {"w": sent}, TIMEOUT)
            store.wait(["received"], TIMEOUT)
        else:
            metadata = store.get("metadata").decode()
            got = carrier.recv_checkpoint(0, metadata, 7, TIMEOUT)["w"]
            store.set("received", "1")
            out.put((type(got).__name__, list(got.to_local().shape), got.to_local().tolist()))
        carrier.shutdown()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("transport", ["pg", "http"])
def test_dtensor_reaches_another_rank_whole(transport: str) -> None:
    ctx = warm.mp_context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, store.port, transport, out), daemon=True) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        kind, shape, values = out.get(timeout=120)
    except queue.Empty:
        raise AssertionError(f"no result; exit codes {[p.exitcode for p in procs]}") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=10)
    assert (kind, shape, values) == ("DTensor", [3], [0.0, 1.0, 2.0])
    assert [p.exitcode for p in procs] == [0, 0]
