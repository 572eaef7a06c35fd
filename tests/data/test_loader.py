"""The plan's shell: shares fetched through a DataLoader (with and without workers), the
read-ahead thrown away when the step or quorum is not the one it guessed, and the window guard."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch.distributed import ReduceOp

from torchheal.data import DataPlan, StepLoader, WindowGuard, share


class Numbers(torch.utils.data.Dataset):
    """Item ``i`` is the tensor ``[i]``: a batch shows which samples it holds."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


@dataclass
class FakeManager:
    """The Manager's step queries, set by the test as a quorum would set them."""

    step: int = 0
    participants: int = 3
    rank: int | None = 0
    committed_batches: int = 0
    errors: list[Exception] = field(default_factory=list)
    flags: list[float] = field(default_factory=list)  # what other groups add to the guard's sum

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return self.participants

    def participating_rank(self) -> int | None:
        return self.rank

    def batches_committed(self) -> int:
        return self.committed_batches

    def is_participating(self) -> bool:
        return self.rank is not None

    def commit(self) -> None:
        self.step += 1
        self.committed_batches += self.participants

    # What WindowGuard needs besides.
    _use_async_quorum = False
    salvage_step = False

    def allreduce(self, tensor, should_quantize=False, reduce_op=ReduceOp.AVG):
        tensor += sum(self.flags)
        return _Done()

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def should_commit(self) -> bool:
        return not self.errors


class _Done:
    def wait(self) -> bool:
        return True


def read(batch) -> list[int]:
    return [int(i) for mb in batch for i in mb.flatten()]


@pytest.mark.parametrize("workers", [0, 2])
def test_each_step_reads_its_share_through_the_quorums_and_failures(workers: int) -> None:
    plan = DataPlan(dataset_size=200, batch_size=12, micro_batch=4, seed=1)
    m = FakeManager()
    loader = StepLoader(
        Numbers(200), plan, m, num_workers=workers, prefetch_factor=4 if workers else None
    )
    script = [  # (participants, rank, commit?)
        (3, 0, True),
        (3, 0, True),
        (3, 0, False),
        (2, 0, True),
        (2, 0, True),
        (2, 1, False),
        (3, 2, True),
        (3, 2, True),
        (1, 0, True),
    ]
    for k, r, ok in script:
        m.participants, m.rank = k, r
        batch = loader.next_step()
        want = share(plan, batch.share.key)
        assert batch.share.key.step == m.step and batch.share.key.participants == k
        assert read(batch) == list(want.indices), f"step {m.step} with {k} groups, rank {r}"
        assert len(batch) == len(want.micro_batches) and batch.loss_scale == k / 12
        if ok:
            m.commit()
    # The read-ahead guessed wrong at the retry of each failed step and at each quorum
    # change, only then.
    assert loader.restarts == 4
    loader.close()


def test_a_healing_group_reads_one_filler_sample() -> None:
    m = FakeManager(rank=None, participants=2)
    loader = StepLoader(Numbers(50), DataPlan(dataset_size=50, batch_size=8), m)
    batch = loader.next_step()
    assert batch.loss_scale == 0.0 and batch.indices == ()
    assert len(read(batch)) == 1


def test_inner_steps_read_with_the_windows_quorum_and_the_guard_fails_a_changed_sync() -> None:
    plan = DataPlan(dataset_size=500, batch_size=6, inner_steps=3)
    m = FakeManager(participants=0, rank=None)  # before any sync
    loader = StepLoader(Numbers(500), plan, m, initial=(3, 1))
    guard = WindowGuard(m, loader)
    first = [loader.next_step().share for _ in range(3)]
    assert [(s.key.participants, s.key.rank, s.key.inner) for s in first] == [
        (3, 1, j) for j in range(3)
    ]
    assert [s.start for s in first] == [0, 6, 12]
    m.participants, m.rank = 3, 1  # the sync's quorum is the one guessed
    assert guard.should_commit() and not m.errors
    m.commit()
    [loader.next_step() for _ in range(3)]
    m.participants, m.rank = 2, 1  # a group died during the window
    assert not guard.should_commit() and len(m.errors) == 1 and guard.stale_syncs == 1
    m.errors.clear()
    again = [loader.next_step().share for _ in range(3)]  # the same step, the new quorum
    assert [(s.key.step, s.key.participants, s.start) for s in again] == [
        (1, 2, 18),
        (1, 2, 24),
        (1, 2, 30),
    ]
    # Another group's stale window fails this group's sync too; a healer's guess never counts.
    m.flags = [1.0]
    assert not guard.should_commit()
    m.errors.clear()
    m.flags, m.rank = [], None
    loader._window = None
    assert guard.should_commit()


def test_the_plan_decides_batches() -> None:
    with pytest.raises(ValueError, match="'batch_size' is the plan's"):
        StepLoader(
            Numbers(10), DataPlan(dataset_size=10, batch_size=2), FakeManager(), batch_size=4
        )
    with pytest.raises(ValueError, match="holds 10 samples, the plan 11"):
        StepLoader(Numbers(10), DataPlan(dataset_size=11, batch_size=2), FakeManager())


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_or_healed_group_reads_on_from_its_step_with_no_loader_state(
    workers: int,
) -> None:
    plan = DataPlan(dataset_size=300, batch_size=9, micro_batch=3, seed=4)
    kwargs = {"num_workers": workers}
    m = FakeManager(participants=3, rank=2)
    through = StepLoader(Numbers(300), plan, m, **kwargs)
    seen = {}
    for _ in range(6):
        seen[m.step] = read(through.next_step())
        m.commit()
    through.close()
    # A new process whose Manager state came from a checkpoint or a healing peer (step 3).
    resumed = FakeManager(step=3, participants=3, rank=2, committed_batches=9)
    loader = StepLoader(Numbers(300), plan, resumed, **kwargs)
    for step in range(3, 6):
        assert read(loader.next_step()) == seen[step], f"step {step}"
        resumed.commit()
    loader.close()
