"""DTensors on the checkpoint wire: described by the sender, checked and rebuilt by the receiver.

A DTensor travels as its local shard (an ordinary tensor of the description) plus a JSON entry
with its mesh, placements, global shape and stride. The receiver checks that entry fully before
anything reaches torch, and rebuilds the DTensor around the shard that arrived.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from torchheal.checkpointing._format import MAX_DIMS
from torchheal.checkpointing.transport import CheckpointError

__all__ = ["describe_dtensor", "parse_dtensor", "rebuild_dtensor"]


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) > MAX_DIMS:
        raise CheckpointError(f"invalid checkpoint description: {what} = {value!r}")
    if any(type(v) is not int or v < 0 for v in value):
        raise CheckpointError(f"invalid checkpoint description: {what} = {value!r}")
    return tuple(value)


def describe_dtensor(t: Any) -> dict[str, Any]:
    """Describes a DTensor's mesh and placements as plain JSON data (its shard travels apart)."""
    placements = []
    for p in t.placements:
        if p.is_shard():
            placements.append(["shard", int(p.dim)])
        elif p.is_replicate():
            placements.append(["replicate"])
        elif p.is_partial():
            placements.append(["partial", str(getattr(p, "reduce_op", "sum"))])
        else:
            raise CheckpointError(f"unsupported DTensor placement {p!r}")
    mesh = t.device_mesh
    return {
        "device_type": mesh.device_type,
        "mesh": mesh.mesh.tolist(),
        "dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "placements": placements,
        "shape": list(t.shape),
        "stride": list(t.stride()),
    }


# Device types a DTensor may name; anything else would reach torch as an attribute name.
_MESH_DEVICE_TYPES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "meta"})
_PARTIAL_OPS = frozenset({"sum", "avg", "max", "min", "product"})
# A mesh bigger than this is not a real job's.
_MAX_MESH_RANKS = 1 << 20


def parse_dtensor(what: str, dt: Any) -> dict[str, Any]:
    """Validates a received DTensor description; returns it as plain, checked data.

    Nothing in it reaches torch before it passed; ``what`` names its place in messages.
    """

    def bad(field: str) -> CheckpointError:
        return CheckpointError(f"invalid checkpoint description: {what}.{field}")

    if type(dt) is not dict:
        raise CheckpointError(f"invalid checkpoint description: {what}")
    device_type = dt.get("device_type")
    if type(device_type) is not str or device_type not in _MESH_DEVICE_TYPES:
        raise bad(f"device_type = {str(device_type)[:40]!r}")
    mesh, mesh_shape = dt.get("mesh"), []
    level = [mesh]
    while level and type(level[0]) is list:
        sizes = {len(row) if type(row) is list else -1 for row in level}
        if len(sizes) != 1 or -1 in sizes or 0 in sizes or len(mesh_shape) >= MAX_DIMS:
            raise bad("mesh (not a non-empty rectangular nested list)")
        mesh_shape.append(sizes.pop())
        if math.prod(mesh_shape) > _MAX_MESH_RANKS:
            raise bad("mesh (too many ranks)")
        level = [x for row in level for x in row]
    # A bare rank is a 0-dimensional mesh (torch's DeviceMesh("cpu", 1)), with no placements.
    if any(type(r) is not int or r < 0 for r in level):
        raise bad("mesh (ranks must be integers >= 0)")
    if len(set(level)) != len(level):
        raise bad("mesh (a rank appears twice)")
    shape = _int_list(dt.get("shape"), f"{what}.shape")
    stride = _int_list(dt.get("stride"), f"{what}.stride")
    if len(shape) != len(stride):
        raise bad("shape/stride (ranks differ)")
    placements = dt.get("placements")
    if type(placements) is not list or len(placements) != len(mesh_shape):
        raise bad("placements (one per mesh dimension)")
    for p in placements:
        ok = (
            type(p) is list
            and p
            and (
                (p[0] == "shard" and len(p) == 2 and type(p[1]) is int and 0 <= p[1] < len(shape))
                or (p[0] == "replicate" and len(p) == 1)
                or (
                    p[0] == "partial" and len(p) == 2 and type(p[1]) is str and p[1] in _PARTIAL_OPS
                )
            )
        )
        if not ok:
            raise bad(f"placements ({str(p)[:40]})")
    names = dt.get("dim_names")
    if names is not None and (
        type(names) is not list
        or len(names) != len(mesh_shape)
        or any(type(n) is not str or len(n) > 256 for n in names)
    ):
        raise bad("dim_names")
    return {
        "device_type": device_type,
        "mesh": mesh,
        "dim_names": names,
        "placements": placements,
        "shape": list(shape),
        "stride": list(stride),
    }


def rebuild_dtensor(local: torch.Tensor, spec: Mapping[str, Any]) -> Any:
    """Rebuilds a DTensor around the received local shard, with the sender's mesh and placements.

    The receiver is usually not in the sender's mesh, where ``DTensor.from_local`` would give
    an empty local tensor, so the DTensor is built from its spec (as the reference does).
    """
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        kinds = {"shard": lambda p: Shard(p[1]), "replicate": lambda p: Replicate()}
        kinds["partial"] = lambda p: Partial(p[1])
        placements = tuple(kinds[p[0]](p) for p in spec["placements"])
        names = spec["dim_names"]
        mesh = DeviceMesh(
            spec["device_type"],
            torch.tensor(spec["mesh"], dtype=torch.int64),
            mesh_dim_names=tuple(names) if names else None,
            _init_backend=False,
        )
        meta = TensorMeta(torch.Size(spec["shape"]), tuple(spec["stride"]), local.dtype)
        return DTensor(local, DTensorSpec(mesh, placements, tensor_meta=meta), requires_grad=False)
    except Exception as e:  # broad: any failure to rebuild is this transfer's error
        raise CheckpointError(f"cannot rebuild DTensor from checkpoint: {e}") from e
