"""The data plan's shell: a step's share fetched through a ``torch.utils.data.DataLoader``.

``StepLoader`` asks the Manager where the step stands, asks the plan for this rank's share, and
hands back its micro-batches, loaded by a DataLoader. The DataLoader reads ahead before the step
is known, so its batch sampler *guesses* (next step, same quorum) and every batch carries its
indices; a batch the plan did not ask for drops the read-ahead, which restarts from the true
step. A wrong guess costs a re-read, never a wrong batch.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import default_collate

from torchheal.data.order import Order
from torchheal.data.plan import DataPlan, Share, StepKey, next_key, share

logger = logging.getLogger(__name__)


class StepSource(Protocol):
    """What the loader reads from :class:`torchheal.Manager` (its public API only)."""

    def current_step(self) -> int: ...
    def num_participants(self) -> int: ...
    def participating_rank(self) -> int | None: ...
    def batches_committed(self) -> int: ...
    def is_participating(self) -> bool: ...


class _Indexed(Dataset):  # type: ignore[type-arg]
    """The user's dataset, each item returned with its index (so a batch says what it holds)."""

    def __init__(self, dataset: Dataset) -> None:  # type: ignore[type-arg]
        self.dataset = dataset

    def __getitem__(self, i: int) -> tuple[int, Any]:
        return i, self.dataset[i]


class _Collate:
    """Collates the user's items and keeps their indices beside them (picklable for workers)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[tuple[int, Any]]) -> tuple[tuple[int, ...], Any]:
        return tuple(i for i, _ in items), self.collate_fn([x for _, x in items])


class _Schedule:
    """The DataLoader's batch sampler: micro-batches of the guessed steps, from ``start``."""

    def __init__(self, plan: DataPlan, share_of: Callable[[StepKey], Share]) -> None:
        self.plan, self.share_of = plan, share_of
        self.start: StepKey | None = None
        self.skip = 0  # micro-batches of the first step already taken

    def __iter__(self) -> Iterator[list[int]]:
        key, skip = self.start, self.skip
        assert key is not None, "the loader sets where to start before it iterates"
        while True:
            for mb in self.share_of(key).micro_batches[skip:]:
                yield list(mb)
            key, skip = next_key(self.plan, key), 0


class StepBatch:
    """One rank's data for one step: iterate for its micro-batches (collated, in order).

    Args:
        share: what the plan assigned.
        loader: the loader that fetches it.
    """

    def __init__(self, share: Share, loader: StepLoader) -> None:
        self.share = share
        self._loader = loader

    @property
    def loss_scale(self) -> float:
        """Multiply the sum of per-sample losses by this (0 for a filler)."""
        return self.share.loss_scale

    @property
    def indices(self) -> tuple[int, ...]:
        """The dataset indices that count in this step for this rank."""
        return self.share.indices

    def __len__(self) -> int:
        return len(self.share.micro_batches)

    def __iter__(self) -> Iterator[Any]:
        for j, mb in enumerate(self.share.micro_batches):
            yield self._loader._fetch(self.share.key, j, mb)


class StepLoader:
    """This rank's share of every step, from the data plan, through a DataLoader.

    DDP/HSDP: call :meth:`next_step` once per step, after ``start_quorum`` (the optimizer
    wrapper's ``zero_grad``); it waits for the quorum (``participating_rank()``). LocalSGD/DiLoCo
    (``plan.inner_steps > 1``): call it once per inner step; a window reads with the quorum of
    the last sync (``initial`` before the first), and :class:`~torchheal.data.guard.WindowGuard`
    makes a sync whose quorum differs fail, so the window is read again by the new quorum.

    Args:
        dataset: a map-style dataset of ``plan.dataset_size`` samples.
        plan: the layout (the same on every rank of every group).
        manager: the Manager (anything with the step queries of ``StepSource``).
        group_rank: this rank inside its replica group.
        group_size: ranks of the group that split its share.
        initial: ``(participants, rank)`` to assume for a LocalSGD/DiLoCo window read before
            any quorum; None: read nothing that counts until the first sync.
        collate_fn: the DataLoader's collate function (its default when None).
        **loader_kwargs: passed to ``torch.utils.data.DataLoader``; with workers,
            ``persistent_workers`` defaults to True, so a restarted read-ahead reuses them.
    """

    def __init__(
        self,
        dataset: Dataset,  # type: ignore[type-arg]
        plan: DataPlan,
        manager: StepSource,
        *,
        group_rank: int = 0,
        group_size: int = 1,
        initial: tuple[int, int] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        size = len(dataset)  # type: ignore[arg-type]
        if size != plan.dataset_size:
            raise ValueError(f"the dataset holds {size} samples, the plan {plan.dataset_size}")
        for reserved in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if reserved in loader_kwargs:
                raise ValueError(f"{reserved!r} is the plan's to decide; leave it out")
        if not 0 <= group_rank < group_size:
            raise ValueError(f"group_rank {group_rank} is outside 0..{group_size - 1}")
        self.plan = plan
        self.manager = manager
        self.group_rank, self.group_size = group_rank, group_size
        self.initial = initial
        self.order = Order(plan.dataset_size, plan.seed, plan.shuffle)
        # Shares by key: the read-ahead computes the next step's, next_step finds it here.
        self._shares: OrderedDict[StepKey, Share] = OrderedDict()
        self._schedule = _Schedule(plan, self.share_of)
        if loader_kwargs.get("num_workers", 0) > 0:
            loader_kwargs.setdefault("persistent_workers", True)
        self._loader = DataLoader(
            _Indexed(dataset),
            batch_sampler=self._schedule,  # type: ignore[arg-type]
            collate_fn=_Collate(collate_fn or default_collate),
            **loader_kwargs,
        )
        self._it: Iterator[Any] | None = None
        self._calls = 0  # data steps handed out (the inner step is its remainder)
        self._window: StepKey | None = None
        self.restarts = 0  # read-aheads dropped because the guess was wrong
        self._warned = False

    @property
    def window(self) -> StepKey | None:
        """The key of the last step handed out (LocalSGD/DiLoCo: the window's quorum)."""
        return self._window

    def key(self) -> StepKey:
        """The next data step's key, from the Manager (waits for the quorum in flight)."""
        m = self.manager
        inner = self._calls % self.plan.inner_steps
        if inner and self._window is not None:
            return replace(self._window, inner=inner)
        rank = m.participating_rank()  # first: waits for the quorum, then the rest is settled
        count = m.num_participants()
        if rank is not None and not m.is_participating() and not self._warned:
            # An asynchronous quorum with init_sync at step 0: every group but the primary heals
            # and sends zeros, yet counts as a participant, so their shares are lost this step.
            self._warned = True
            logger.warning(
                "step %d: this group holds a participant's rank but its gradients will not "
                "count (it heals from the primary at step 0: init_sync with an asynchronous "
                "quorum); its share of the step is lost. For exactly-once data, build the "
                "Manager with init_sync=False (and identical initial weights) or "
                "use_async_quorum=False",
                m.current_step(),
            )
        if self.plan.inner_steps > 1 and count == 0 and self.initial is not None:
            count, rank = self.initial  # a window before any sync: assume everyone is there
        return StepKey(m.current_step(), count, rank, inner, m.batches_committed())

    def share_of(self, key: StepKey) -> Share:
        """This rank's share of the step ``key`` (the plan's, kept for a few steps)."""
        found = self._shares.get(key)
        if found is None:
            found = share(self.plan, key, self.group_rank, self.group_size, self.order)
            self._shares[key] = found
            if len(self._shares) > 8:
                self._shares.popitem(last=False)
        return found

    def next_step(self) -> StepBatch:
        """This rank's share of the next data step (see the class doc for when to call)."""
        key = self.key()
        self._calls += 1
        self._window = key
        return StepBatch(self.share_of(key), self)

    def _fetch(self, key: StepKey, j: int, expected: Sequence[int]) -> Any:
        """Micro-batch ``j`` of step ``key``, from the read-ahead when it guessed right."""
        for attempt in range(2):
            if self._it is None:
                self._schedule.start, self._schedule.skip = key, j
                self._it = iter(self._loader)
            got, data = next(self._it)
            if tuple(got) == tuple(expected):
                return data
            # A wrong guess: drop the read-ahead and restart it from this step.
            self._it = None
            if attempt == 0:
                self.restarts += 1
        raise RuntimeError(f"the loader read {got}, the plan asks for {tuple(expected)}")

    def close(self) -> None:
        """Stops the DataLoader's workers (dropping the DataLoader ends them); no use after."""
        self._it = None
        self._loader = None  # type: ignore[assignment]
