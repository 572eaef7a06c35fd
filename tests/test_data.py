"""DistributedSampler: one shard per (replica group, group rank) pair."""

import pytest

from torchheal.data import DistributedSampler


def test_global_rank_and_first_index() -> None:
    dataset = list(range(1000))
    sampler = DistributedSampler(
        dataset, replica_rank=1, num_replica_groups=2, group_rank=3, num_replicas=4
    )
    assert sampler.global_rank == 7
    assert sampler.global_world_size == 8
    assert sampler.rank == 7 and sampler.num_replicas == 8
    indices = list(iter(sampler))
    assert len(indices) == 125
    assert indices[0] == 500  # default shuffle, seed 0


def test_shards_are_disjoint_and_cover_the_dataset() -> None:
    dataset = list(range(64))
    seen: list[int] = []
    for replica_rank in range(2):
        for group_rank in range(4):
            sampler = DistributedSampler(
                dataset,
                replica_rank=replica_rank,
                num_replica_groups=2,
                group_rank=group_rank,
                num_replicas=4,
                shuffle=False,
            )
            seen.extend(sampler)
    assert sorted(seen) == dataset


def test_bad_replica_rank() -> None:
    with pytest.raises(ValueError, match="replica_rank 2"):
        DistributedSampler(list(range(10)), 2, 2, group_rank=0, num_replicas=1)
