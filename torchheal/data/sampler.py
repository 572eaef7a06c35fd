"""DistributedSampler: one shard per (replica group, group rank) pair, the reference's lossy way.

While a replica group is down, its shard of the data is skipped rather than redistributed.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils import data


class DistributedSampler(data.distributed.DistributedSampler):
    """A ``torch.utils.data.DistributedSampler`` over all ranks of all replica groups.

    The global rank is ``group_rank + num_replicas * replica_rank`` of
    ``num_replicas * num_replica_groups``.

    Args:
        dataset: the dataset to sample.
        replica_rank: index of this replica group.
        num_replica_groups: number of replica groups.
        group_rank: rank inside the replica group (``dist.get_rank()`` when None).
        num_replicas: ranks per replica group (``dist.get_world_size()`` when None).
        **kwargs: passed to ``torch.utils.data.DistributedSampler`` (shuffle, seed, drop_last).
    """

    def __init__(
        self,
        dataset: data.Dataset[Any],
        replica_rank: int,
        num_replica_groups: int,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        **kwargs: Any,
    ) -> None:
        if group_rank is None:
            group_rank = dist.get_rank()
        if num_replicas is None:
            num_replicas = dist.get_world_size()
        if not 0 <= replica_rank < num_replica_groups:
            raise ValueError(f"replica_rank {replica_rank} is outside 0..{num_replica_groups - 1}")
        self.global_rank: int = group_rank + num_replicas * replica_rank
        self.global_world_size: int = num_replicas * num_replica_groups
        super().__init__(
            dataset, num_replicas=self.global_world_size, rank=self.global_rank, **kwargs
        )
