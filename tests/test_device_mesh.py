"""ManagedDeviceMesh and friends on a real 2-rank Gloo world (one replica group).

The replicate dimension is a ManagedProcessGroup over a stand-in manager: the mesh only asks
the manager for ``num_participants`` and routes all-reduces to it, so a small recording double
is enough to check what the mesh reports and where reductions go. The double also has a
participating rank, which the mesh must not report (see test_ranks_and_coordinates).
"""

from __future__ import annotations

import multiprocessing
import pickle
import socket
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import warm

WORLD = 2


class StandInManager:
    """Records all-reduces (and scales by 10 so routing is visible); fixed participation."""

    def __init__(self, participants: int, replica_rank: int | None) -> None:
        from torchheal.process_group.dummy import ProcessGroupDummy

        self._pg = ProcessGroupDummy()
        self.participants = participants
        self.replica_rank = replica_rank
        self.ops: list[str] = []

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None):
        from torchheal.process_group.work import _DummyWork

        self.ops.append(getattr(reduce_op, "op", reduce_op).name)
        tensor.mul_(10)
        return _DummyWork(tensor)

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int | None:
        return self.replica_rank


def _observe(rank: int) -> dict[str, Any]:
    import torch.distributed._functional_collectives as funcol

    from torchheal.device_mesh import ManagedDeviceMesh, extend_device_mesh, ft_init_device_mesh
    from torchheal.process_group.dummy import ProcessGroupDummy

    out: dict[str, Any] = {}
    manager = StandInManager(participants=0, replica_rank=None)
    mesh = ft_init_device_mesh(
        device_type="cpu",
        mesh_shape=(2, WORLD),
        mesh_dim_names=("dp_replicate", "dp_shard"),
        replicate_dim=0,
        manager=manager,
    )
    # Before any quorum: 0 participants reported as 1.
    out["size_before"] = (mesh.size(), mesh.size(0), mesh.size(1), mesh.shape)
    manager.participants, manager.replica_rank = 3, 2
    out["size"] = (mesh.size(), mesh.size("dp_replicate"), mesh.size("dp_shard"), mesh.shape)
    out["ndim"] = mesh.ndim
    out["coordinate"] = mesh.get_coordinate()
    out["local_rank"] = (mesh.get_local_rank(), mesh.get_local_rank(0), mesh.get_local_rank(1))
    out["groups"] = (
        mesh.get_group() is mesh.replicate_pg,
        mesh.get_group("dp_replicate") is mesh.replicate_pg,
        dist.get_process_group_ranks(mesh.get_group("dp_shard")),
    )
    rep = mesh["dp_replicate"]
    out["rep"] = (type(rep).__name__, rep.inner_mesh, rep.ndim, rep.size(), rep.get_coordinate())
    shard = mesh["dp_shard"]
    out["shard"] = (type(shard).__name__, shard.size(), shard.get_local_rank())
    out["tuple_self"] = mesh["dp_replicate", "dp_shard"] is mesh
    swapped = mesh["dp_shard", "dp_replicate"]
    out["swapped"] = (swapped.replicate_dim, swapped.get_coordinate(), swapped.shape)

    flat = mesh._flatten("dp")
    out["flat"] = (flat.size(), flat.get_local_rank(), mesh["dp"] is flat)

    # Pickling drops the process group and restores this process's singleton.
    clone = pickle.loads(pickle.dumps(mesh))
    out["pickle"] = (
        clone == mesh,
        hash(clone) == hash(mesh),
        clone.replicate_pg is mesh.replicate_pg,
    )
    out["hash_differs"] = hash(mesh) != hash(swapped) and mesh != swapped
    out["repr"] = repr(mesh)

    # Reductions on the replicate group go through the manager, by object and by name.
    t = torch.ones(2)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=mesh.get_group(0))
    r = funcol.all_reduce(torch.ones(2), "sum", mesh.get_group(0).group_name)
    m = funcol.all_reduce(torch.ones(2), "max", (mesh, 0))
    out["reduce"] = (
        t.tolist(),
        funcol.wait_tensor(r).tolist(),
        funcol.wait_tensor(m).tolist(),
        list(manager.ops),
    )
    # Reductions on the shard dimension stay plain Gloo.
    s = torch.full((1,), float(rank + 1))
    dist.all_reduce(s, group=mesh.get_group("dp_shard"))
    out["shard_sum"] = s.item()

    # Replicate dimension last: coordinate order follows mesh_dim_names.
    last = ManagedDeviceMesh(
        mesh.inner_mesh, ("dp_shard", "dp_replicate"), mesh.replicate_pg, 1, device_type="cpu"
    )
    out["last"] = (last.get_coordinate(), last.shape, last.size(1))
    with_errors = []
    for bad in (lambda: mesh["nope"], lambda: mesh._flatten(), lambda: last.get_local_rank()):
        try:
            bad()
        except (KeyError, ValueError) as e:
            with_errors.append(type(e).__name__)
    out["errors"] = with_errors

    # extend_device_mesh adds a world-size-1 dimension backed by a torchheal group.
    ext = extend_device_mesh(mesh.inner_mesh, ProcessGroupDummy(), name="ft", dim=0)
    out["extended"] = (ext.mesh_dim_names, ext.shape, type(ext.get_group("ft")).__name__)
    return out


def _worker(rank: int, port: int, queue: multiprocessing.Queue) -> None:
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
        )
        try:
            queue.put((rank, _observe(rank)))
        finally:
            dist.destroy_process_group()
    except Exception:
        queue.put((rank, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def observations() -> dict[int, dict[str, Any]]:
    ctx = warm.mp_context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for rank, res in results.items():
        assert isinstance(res, dict), f"rank {rank} failed:\n{res}"
    return results


@pytest.mark.parametrize("rank", range(WORLD))
def test_sizes_and_shape(observations: dict[int, dict[str, Any]], rank: int) -> None:
    o = observations[rank]
    assert o["size_before"] == (WORLD, 1, WORLD, (0, WORLD))
    assert o["size"] == (3 * WORLD, 3, WORLD, (3, WORLD))
    assert o["ndim"] == 2


@pytest.mark.parametrize("rank", range(WORLD))
def test_ranks_and_coordinates(observations: dict[int, dict[str, Any]], rank: int) -> None:
    o = observations[rank]
    # The replicate coordinate is the façade's rank, 0, as in the reference, even though this
    # replica participates with rank 2: torchtitan adds its own replica offset to the dp rank.
    assert o["coordinate"] == (0, rank)
    assert o["local_rank"] == (rank, 0, rank)
    assert o["swapped"] == (1, (rank, 0), (WORLD, 3))
    # The reference swapped list.insert's arguments; the replicate coordinate belongs at its dim.
    assert o["last"] == ((rank, 0), (WORLD, 3), 3)


@pytest.mark.parametrize("rank", range(WORLD))
def test_slicing_groups_and_flatten(observations: dict[int, dict[str, Any]], rank: int) -> None:
    o = observations[rank]
    assert o["groups"] == (True, True, list(range(WORLD)))
    assert o["rep"] == ("ManagedDeviceMesh", None, 1, 3, (0,))
    assert o["shard"] == ("DeviceMesh", WORLD, rank)
    assert o["tuple_self"] is True
    # The flattened dp rank is the rank within this replica group; its size counts participants.
    assert o["flat"] == (3 * WORLD, rank, True)
    assert o["errors"] == ["KeyError", "ValueError", "ValueError"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_pickle_hash_repr(observations: dict[int, dict[str, Any]], rank: int) -> None:
    o = observations[rank]
    assert o["pickle"] == (True, True, True)
    assert o["hash_differs"] is True
    assert o["repr"].startswith("ManagedDeviceMesh(")
    assert "dp_replicate" in o["repr"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_replicate_reductions_go_through_manager(
    observations: dict[int, dict[str, Any]], rank: int
) -> None:
    o = observations[rank]
    assert o["reduce"] == ([10.0, 10.0], [10.0, 10.0], [10.0, 10.0], ["AVG", "SUM", "MAX"])
    assert o["shard_sum"] == 3.0


@pytest.mark.parametrize("rank", range(WORLD))
def test_extend_device_mesh(observations: dict[int, dict[str, Any]], rank: int) -> None:
    assert observations[rank]["extended"] == (("ft", "dp_shard"), (1, WORLD), "ProcessGroupDummy")
