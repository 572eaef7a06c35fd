"""Fault-tolerant HSDP: a device mesh whose replicate dimension is driven by a Manager.

:class:`ManagedDeviceMesh` is a real ``DeviceMesh`` whose replicate dimension is, underneath, of
world size 1: the Manager keeps replicas identical, not DTensor. Its queries report the managed
view: the replicate size is the number of participants (at least 1), the replicate coordinate 0,
as in the reference. Unlike the reference, ``get_coordinate`` puts that coordinate at the
replicate dimension (the reference swapped ``list.insert``'s arguments).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchheal.process_group.base import ProcessGroup
from torchheal.process_group.managed import ManagedProcessGroup, _ManagerLike

__all__ = [
    "ManagedDeviceMesh",
    "extend_device_mesh",
    "ft_init_device_mesh",
]


def _group_name(pg: dist.ProcessGroup, name: str) -> str:
    # torchheal groups get a name only once registered; register on first use so a mesh can
    # resolve them by name (DeviceMesh and functional collectives look groups up by name).
    if isinstance(pg, ProcessGroup):
        try:
            return pg.group_name
        except ValueError:
            pg.register(name)
            return pg.group_name
    return pg.group_name


def _mesh_groups(mesh: DeviceMesh) -> list[dist.ProcessGroup]:
    return [mesh.get_group(i) for i in range(mesh.ndim)]


def extend_device_mesh(
    mesh: DeviceMesh, pg: dist.ProcessGroup, name: str = "dp", dim: int = 0
) -> DeviceMesh:
    """Adds ``pg`` to ``mesh`` as a new world-size-1 dimension (DTensor never communicates over it).

    A torchheal ``ProcessGroup`` not registered yet is registered as ``name``.

    Args:
        mesh: the existing mesh (every dimension must have a process group).
        pg: the process group of the new dimension.
        name: the new dimension's name.
        dim: where the new dimension goes (0 = outermost).
    """
    names = list(mesh.mesh_dim_names or ())
    if len(names) != mesh.ndim:
        raise ValueError("extend_device_mesh needs a mesh with mesh_dim_names")
    if name in names:
        raise ValueError(f"extend_device_mesh: {name!r} is already a dimension of {names}")
    if not 0 <= dim <= mesh.ndim:
        raise ValueError(f"extend_device_mesh: dim {dim} out of range for a {mesh.ndim}-D mesh")
    _group_name(pg, name)
    groups = _mesh_groups(mesh)
    groups.insert(dim, pg)
    names.insert(dim, name)
    return DeviceMesh.from_group(
        groups,
        mesh.device_type,
        mesh=mesh.mesh.unsqueeze(dim),
        mesh_dim_names=tuple(names),
    )


class _FlattenDeviceMesh:
    """A flattened view of a :class:`ManagedDeviceMesh`: only ``size()`` and ``get_local_rank()``
    (no process group spans every replica group's ranks)."""

    def __init__(self, managed_mesh: ManagedDeviceMesh, name: str) -> None:
        self.managed_mesh = managed_mesh
        self.name = name

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The single flattened dimension's name."""
        return (self.name,)

    @property
    def ndim(self) -> int:
        """Always 1."""
        return 1

    def size(self, mesh_dim: int | None = None) -> int:
        """Total number of ranks across participating replica groups."""
        if mesh_dim not in (None, 0):
            raise IndexError(f"a flattened mesh has one dimension, got mesh_dim={mesh_dim}")
        return self.managed_mesh.size()

    def get_local_rank(self, mesh_dim: int | None = None) -> int:
        """This rank's index in the flattened view."""
        if mesh_dim not in (None, 0):
            raise IndexError(f"a flattened mesh has one dimension, got mesh_dim={mesh_dim}")
        return self.managed_mesh.get_local_rank()

    def get_group(self, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
        """Not available: no single process group spans the flattened view."""
        raise NotImplementedError(
            f"flattened managed mesh {self.name!r} has no process group (replicas communicate "
            "through the Manager)"
        )

    def __repr__(self) -> str:
        return f"_FlattenDeviceMesh(name={self.name!r}, mesh={self.managed_mesh!r})"


class ManagedDeviceMesh(DeviceMesh):
    """A ``DeviceMesh`` whose replicate dimension is a :class:`ManagedProcessGroup`.

    Usually made by :func:`ft_init_device_mesh` and passed (or its
    ``["dp_replicate", "dp_shard"]`` slice) to ``fully_shard``.

    Args:
        mesh: the mesh of the other dimensions over this replica group's ranks, or ``None`` for
            the replicate dimension alone.
        mesh_dim_names: names of all dimensions, the replicate one included.
        replicate_pg: the managed process group of the replicate dimension (registered).
        replicate_dim: index of the replicate dimension in ``mesh_dim_names``.
        parent: the mesh this one was sliced from (``None`` for a root mesh).
        device_type: device type when ``mesh`` is ``None`` (default: the parent's, else
            ``"cuda"`` when available, else ``"cpu"``).
    """

    # Restored into unpickled meshes (process groups do not pickle); set by ft_init_device_mesh.
    replicate_pg_singleton: ClassVar[ManagedProcessGroup | None] = None

    def __init__(
        self,
        mesh: DeviceMesh | None,
        mesh_dim_names: tuple[str, ...],
        replicate_pg: ManagedProcessGroup,
        replicate_dim: int,
        parent: ManagedDeviceMesh | None = None,
        *,
        device_type: str | None = None,
    ) -> None:
        mesh_dim_names = tuple(mesh_dim_names)
        if not 0 <= replicate_dim < len(mesh_dim_names):
            raise ValueError(
                f"replicate_dim {replicate_dim} out of range for mesh_dim_names {mesh_dim_names}"
            )
        inner_names = mesh_dim_names[:replicate_dim] + mesh_dim_names[replicate_dim + 1 :]
        if mesh is None:
            if inner_names:
                raise ValueError(
                    f"mesh is None but mesh_dim_names {mesh_dim_names} name other dimensions"
                )
            if device_type is None:
                device_type = parent.device_type if parent is not None else _default_device_type()
            tensor = torch.tensor([dist.get_rank()], dtype=torch.int)
            groups: list[dist.ProcessGroup] = []
        else:
            if tuple(mesh.mesh_dim_names or ()) != inner_names:
                raise ValueError(
                    f"mesh dimensions {mesh.mesh_dim_names} do not match {inner_names} "
                    f"(mesh_dim_names without the replicate dimension)"
                )
            device_type = mesh.device_type
            tensor = mesh.mesh.unsqueeze(replicate_dim)
            groups = _mesh_groups(mesh)
        groups.insert(replicate_dim, replicate_pg)

        # The DeviceMesh underneath: real groups, replicate dimension of size 1 (see module doc).
        super().__init__(device_type, tensor, mesh_dim_names=mesh_dim_names, _init_backend=False)
        self._dim_group_names = [_group_name(g, mesh_dim_names[replicate_dim]) for g in groups]
        for name, group in zip(self._dim_group_names, groups, strict=True):
            self._pg_registry[name] = group

        self._inner = mesh
        self.replicate_pg = replicate_pg
        self.replicate_dim = replicate_dim
        self.replicate_dim_name = mesh_dim_names[replicate_dim]
        self.parent = parent
        self._flatten_meshes: dict[str, _FlattenDeviceMesh] = {}
        self._managed_hash: int | None = None

    # -- structure -------------------------------------------------------------------------

    @property
    def inner_mesh(self) -> DeviceMesh | None:
        """The mesh of the non-replicate dimensions (``None`` for the replicate dim alone)."""
        return self._inner

    def _root(self) -> ManagedDeviceMesh:
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    def _dim_index(self, mesh_dim: int | str) -> int:
        names = self.mesh_dim_names or ()
        if isinstance(mesh_dim, str):
            if mesh_dim not in names:
                raise KeyError(f"{mesh_dim!r} is not a dimension of {names}")
            return names.index(mesh_dim)
        if not -len(names) <= mesh_dim < len(names):
            raise IndexError(f"mesh_dim {mesh_dim} out of range for a {len(names)}-D mesh")
        return mesh_dim % len(names)

    def _inner_dim(self, dim: int) -> int:
        # Index of a non-replicate dimension in the inner mesh.
        return dim - 1 if dim > self.replicate_dim else dim

    def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> DeviceMesh:  # type: ignore[override]
        """Slices the mesh by dimension name(s): a ``ManagedDeviceMesh`` when the replicate name
        is among them, else the inner mesh's slice, or a view made by :meth:`_flatten`."""
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
        if names == self.mesh_dim_names:
            return self
        if len(names) == 1:
            flattened = self._root()._flatten_meshes.get(names[0])
            if flattened is not None:
                return flattened  # type: ignore[return-value]
        unknown = [n for n in names if n not in (self.mesh_dim_names or ())]
        if unknown or len(set(names)) != len(names):
            raise KeyError(
                f"cannot slice {names} from a mesh with dimensions {self.mesh_dim_names}"
            )
        if self.replicate_dim_name not in names:
            if self._inner is None:  # unreachable: names would be unknown
                raise KeyError(f"no dimensions {names} in {self.mesh_dim_names}")
            return self._inner[names]
        rest = tuple(n for n in names if n != self.replicate_dim_name)
        inner = None if not rest or self._inner is None else self._inner[rest]
        return ManagedDeviceMesh(
            inner, names, self.replicate_pg, names.index(self.replicate_dim_name), parent=self
        )

    def _flatten(self, mesh_dim_name: str | None = None, backend_override: Any = None) -> Any:  # type: ignore[override]
        """A flattened view of this mesh, also reachable as ``root[mesh_dim_name]``."""
        if not mesh_dim_name:
            raise ValueError("ManagedDeviceMesh._flatten needs a mesh_dim_name")
        if backend_override is not None:
            raise ValueError("ManagedDeviceMesh._flatten does not support backend_override")
        flattened = _FlattenDeviceMesh(self, mesh_dim_name)
        self._root()._flatten_meshes[mesh_dim_name] = flattened
        return flattened

    # -- groups and sizes (the managed view) -------------------------------------------------

    def get_group(self, mesh_dim: int | str | None = None) -> dist.ProcessGroup:
        """The process group of a dimension (index or name; ``None``: the replicate one)."""
        if mesh_dim is None:
            return self.replicate_pg
        dim = self._dim_index(mesh_dim)
        if dim == self.replicate_dim:
            return self.replicate_pg
        assert self._inner is not None  # only the replicate dim exists when inner is None
        return self._inner.get_group(self._inner_dim(dim))

    def get_all_groups(self) -> list[dist.ProcessGroup]:
        """The process group of every dimension, in order."""
        return [self.get_group(i) for i in range(self.ndim)]

    def _replicate_size(self) -> int:
        # Before the first quorum the manager reports 0 participants; a mesh never has a
        # dimension of size 0, and this replica is at least one participant.
        return max(1, self.replicate_pg.size())

    def _replicate_rank(self) -> int:
        # The façade's rank (0), not the participating rank: torchtitan adds its replica offset
        # itself, and a rank moving with participation would reshuffle data shards.
        return self.replicate_pg.rank()

    def size(self, mesh_dim: int | str | None = None) -> int:  # type: ignore[override]
        """Number of ranks in a dimension (index or name), or in the whole mesh (``None``)."""
        inner_size = 1 if self._inner is None else self._inner.size()
        if mesh_dim is None:
            return inner_size * self._replicate_size()
        dim = self._dim_index(mesh_dim)
        if dim == self.replicate_dim:
            return self._replicate_size()
        assert self._inner is not None
        return self._inner.size(self._inner_dim(dim))

    @property
    def ndim(self) -> int:
        """Number of dimensions, the replicate one included."""
        return 1 if self._inner is None else self._inner.ndim + 1

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes of the dimensions; the replicate entry is the participant count."""
        sizes = [] if self._inner is None else list(self._inner.shape)
        sizes.insert(self.replicate_dim, self.replicate_pg.size())
        return tuple(sizes)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index in a dimension, or (``None``, needs ``replicate_dim == 0``) in the
        flattened mesh."""
        if mesh_dim is None:
            if self._inner is None:
                return self._replicate_rank()
            if self.replicate_dim != 0:
                raise ValueError(
                    "get_local_rank() of the whole mesh needs the replicate dimension first"
                )
            coordinate = self._inner.get_coordinate()
            if coordinate is None:
                raise RuntimeError("this rank is not part of the mesh")
            inner_rank = 0
            for index, size in zip(coordinate, self._inner.shape, strict=True):
                inner_rank = inner_rank * size + index  # row-major, as a flattened mesh
            return self._inner.size() * self._replicate_rank() + inner_rank
        dim = self._dim_index(mesh_dim)
        if dim == self.replicate_dim:
            return self._replicate_rank()
        assert self._inner is not None
        return self._inner.get_local_rank(self._inner_dim(dim))

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's index in every dimension (``None`` if it is not in the mesh)."""
        if self._inner is None:
            return (self._replicate_rank(),)
        coordinate = self._inner.get_coordinate()
        if coordinate is None:
            return None
        coords = list(coordinate)
        coords.insert(self.replicate_dim, self._replicate_rank())
        return tuple(coords)

    # -- identity, printing, pickling -------------------------------------------------------

    def _managed_key(self) -> tuple[Any, ...]:
        return (
            self._inner,
            self.mesh_dim_names,
            self.replicate_pg,
            self.replicate_dim,
            self.parent,
            self.device_type,
        )

    def __hash__(self) -> int:
        if self._managed_hash is None:
            self._managed_hash = hash(self._managed_key())
        return self._managed_hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, ManagedDeviceMesh):
            return False
        return self._managed_key() == other._managed_key()

    def __repr__(self) -> str:
        return (
            f"ManagedDeviceMesh(mesh={self._inner!r}, mesh_dim_names={self.mesh_dim_names}, "
            f"replicate_dim={self.replicate_dim}, device_type={self.device_type!r})"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("replicate_pg", None)
        state["_managed_hash"] = None  # hash of a process group is per process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        pg = ManagedDeviceMesh.replicate_pg_singleton
        if pg is None:
            raise RuntimeError(
                "unpickling a ManagedDeviceMesh needs ft_init_device_mesh() in this process first"
            )
        self.replicate_pg = pg
        self._pg_registry[self._dim_group_names[self.replicate_dim]] = pg


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def ft_init_device_mesh(
    *,
    device_type: str,
    mesh_shape: tuple[int, ...],
    mesh_dim_names: tuple[str, ...],
    replicate_dim: int,
    manager: _ManagerLike,
) -> ManagedDeviceMesh:
    """Builds a device mesh whose replicate dimension is fault tolerant.

    The other dimensions come from ``init_device_mesh`` over this replica group's ranks; the
    replicate one is a registered :class:`ManagedProcessGroup` over ``manager``, whose size in
    ``mesh_shape`` is only nominal (the real one is the number of participants).

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ...
        mesh_shape: size of every dimension, the replicate one included.
        mesh_dim_names: name of every dimension.
        replicate_dim: index of the replicate dimension.
        manager: this replica group's ``torchheal.Manager``.
    """
    mesh_shape = tuple(mesh_shape)
    mesh_dim_names = tuple(mesh_dim_names)
    if len(mesh_shape) != len(mesh_dim_names):
        raise ValueError(
            f"mesh_shape {mesh_shape} and mesh_dim_names {mesh_dim_names} differ in length"
        )
    if not 0 <= replicate_dim < len(mesh_shape):
        raise ValueError(f"replicate_dim {replicate_dim} out of range for mesh_shape {mesh_shape}")
    inner_shape = mesh_shape[:replicate_dim] + mesh_shape[replicate_dim + 1 :]
    inner_names = mesh_dim_names[:replicate_dim] + mesh_dim_names[replicate_dim + 1 :]
    inner = (
        init_device_mesh(device_type, inner_shape, mesh_dim_names=inner_names)
        if inner_shape
        else None
    )
    replicate_pg = ManagedProcessGroup(manager)
    replicate_pg.register(mesh_dim_names[replicate_dim])
    ManagedDeviceMesh.replicate_pg_singleton = replicate_pg
    return ManagedDeviceMesh(
        inner, mesh_dim_names, replicate_pg, replicate_dim, parent=None, device_type=device_type
    )
