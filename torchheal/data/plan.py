"""The data plan: which samples each rank reads in a step, as a pure function of the step.

Every rule about who reads what lives here; the loader only fetches what this module names.
Inputs are plain numbers from the step's quorum; outputs are frozen values. No torch, no I/O.

* the job reads one stream of positions in a fixed order (``order.py``);
* a step's global batch is the next ``size`` positions: with a constant global batch ``B``,
  step ``s`` reads ``[s*B, (s+1)*B)`` whoever takes part; without it, each participating group
  reads ``b`` samples from where the committed steps ended (``batches_committed * b``);
* participant ``r`` of ``k`` takes the ``r``-th of ``k`` near-equal slices of the step's batch,
  rank ``w`` of its ``W`` ranks the ``w``-th slice of that, cut into micro-batches;
* inner step ``j`` of step ``s`` (LocalSGD/DiLoCo, ``inner_steps=H``) is data step ``s*H + j``.

A failed step is not committed, so its retry reads the same positions split over its quorum:
nothing is lost or read twice, and a healed group needs only its step and the Manager's counters.
See ``docs/data.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchheal.data.order import Order


@dataclass(frozen=True)
class DataPlan:
    """How the job's samples are laid out over its steps.

    Args:
        dataset_size: samples in the dataset.
        batch_size: the global batch ``B`` when ``constant_global_batch``; otherwise the batch
            each participating replica group reads per step.
        constant_global_batch: keep every step at ``B`` samples whichever groups take part.
            False: each group reads ``batch_size`` (the reference's layout), still exactly once.
        seed: the order's seed; every replica group must use the same.
        shuffle: a pseudo-random order per epoch (False: dataset order).
        micro_batch: the most samples one rank processes at once (None: no cap; else >= 2).
        inner_steps: data steps per Manager step (LocalSGD/DiLoCo: inner steps between two
            syncs, ``sync_every // n_fragments`` for DiLoCo); 1 for DDP/HSDP.
    """

    dataset_size: int
    batch_size: int
    constant_global_batch: bool = True
    seed: int = 0
    shuffle: bool = True
    micro_batch: int | None = None
    inner_steps: int = 1

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        if self.dataset_size <= 0:
            raise ValueError(f"dataset_size must be > 0, got {self.dataset_size}")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {self.batch_size}")
        if self.micro_batch is not None and self.micro_batch < 2:
            # Every rank of a group runs as many micro-batches as the one with the largest
            # share; with chunks of one, a rank a sample short would have an empty one.
            raise ValueError(f"micro_batch must be >= 2 or None, got {self.micro_batch}")
        if self.inner_steps <= 0:
            raise ValueError(f"inner_steps must be > 0, got {self.inner_steps}")


@dataclass(frozen=True)
class StepKey:
    """What decides a step's data: the step and its quorum, as this group sees them.

    Args:
        step: the Manager's ``current_step()``.
        participants: ``num_participants()``.
        rank: ``participating_rank()``; None when it does not contribute (healing, a spare).
        inner: the data step inside a LocalSGD/DiLoCo window (0 for DDP).
        batches_committed: ``batches_committed()`` (used only without a constant global batch).
    """

    step: int
    participants: int
    rank: int | None
    inner: int = 0
    batches_committed: int = 0

    @property
    def contributes(self) -> bool:
        """Whether this group reads counted samples in this step."""
        return self.rank is not None and 0 <= self.rank < self.participants


@dataclass(frozen=True)
class Share:
    """One rank's data for one step.

    Args:
        key: the step and quorum it was computed for.
        start: stream position of the step's first sample.
        size: samples in the step's global batch (over all participating groups).
        lo: stream position of this rank's first sample.
        hi: one past this rank's last sample.
        indices: dataset indices of positions ``lo .. hi-1``: the samples that count.
        micro_batches: what to run forward/backward on, in order. A rank with no samples gets
            one filler micro-batch and ``loss_scale`` 0, so its collectives still match.
        loss_scale: multiply the *sum* of the per-sample losses by this (``k * W / size``):
            after averaging over ranks and groups, the step's gradient is the per-sample sum
            divided by ``size``, whoever read how many.
    """

    key: StepKey
    start: int
    size: int
    lo: int
    hi: int
    indices: tuple[int, ...]
    micro_batches: tuple[tuple[int, ...], ...]
    loss_scale: float

    @property
    def filler(self) -> bool:
        """True when the micro-batch is a filler: nothing this rank reads counts."""
        return not self.indices


def _slice(total: int, parts: int, i: int) -> tuple[int, int]:
    """The ``i``-th of ``parts`` near-equal consecutive slices of ``range(total)``."""
    return i * total // parts, (i + 1) * total // parts


def step_window(plan: DataPlan, key: StepKey) -> tuple[int, int]:
    """Stream positions ``(start, size)`` of the step's global batch."""
    data_step = key.step * plan.inner_steps + key.inner
    if plan.constant_global_batch:
        return data_step * plan.batch_size, plan.batch_size
    k = max(key.participants, 0)
    # Every committed Manager step read batch_size * inner_steps per participant.
    start = (key.batches_committed * plan.inner_steps + key.inner * k) * plan.batch_size
    return start, k * plan.batch_size


def micro_batches(indices: tuple[int, ...], count: int) -> tuple[tuple[int, ...], ...]:
    """``indices`` cut into ``count`` near-equal consecutive chunks."""
    return tuple(indices[a:b] for a, b in (_slice(len(indices), count, j) for j in range(count)))


def micro_batch_count(plan: DataPlan, key: StepKey, group_size: int = 1) -> int:
    """How many micro-batches every rank of the group runs in the step.

    The same on every rank of the group, as sharded models (FSDP) run collectives inside it at
    every forward and backward: taken from the group's largest rank share.
    """
    if plan.micro_batch is None or not key.contributes:
        return 1
    _, size = step_window(plan, key)
    g_lo, g_hi = _slice(size, key.participants, key.rank or 0)
    largest = -(-(g_hi - g_lo) // group_size)
    return max(1, -(-largest // plan.micro_batch))


def positions(
    plan: DataPlan, key: StepKey, group_rank: int = 0, group_size: int = 1
) -> tuple[int, int]:
    """Stream positions ``[lo, hi)`` this rank reads in the step (empty when it does not
    contribute): the group's slice of the step's batch, then this rank's slice of that."""
    start, size = step_window(plan, key)
    if not key.contributes:
        return start, start
    g_lo, g_hi = _slice(size, key.participants, key.rank or 0)
    r_lo, r_hi = _slice(g_hi - g_lo, group_size, group_rank)
    return start + g_lo + r_lo, start + g_lo + r_hi


def share(
    plan: DataPlan,
    key: StepKey,
    group_rank: int = 0,
    group_size: int = 1,
    order: Order | None = None,
) -> Share:
    """This rank's share of the step described by ``key``.

    Args:
        plan: the layout.
        key: the step and its quorum.
        group_rank: this rank inside its replica group (tensor-parallel peers pass the same).
        group_size: ranks of the group that split its share (its data-parallel degree).
        order: the plan's order, to reuse its cache (built from ``plan`` when None).
    """
    if not 0 <= group_rank < group_size:
        raise ValueError(f"group_rank {group_rank} is outside 0..{group_size - 1}")
    if key.inner >= plan.inner_steps or key.inner < 0:
        raise ValueError(f"inner step {key.inner} is outside 0..{plan.inner_steps - 1}")
    order = order if order is not None else Order(plan.dataset_size, plan.seed, plan.shuffle)
    start, size = step_window(plan, key)
    lo, hi = positions(plan, key, group_rank, group_size)
    indices = order.indices(lo, hi)
    if indices:
        scale = key.participants * group_size / size
        mbs = micro_batches(indices, micro_batch_count(plan, key, group_size))
    else:
        scale = 0.0
        mbs = ((order.index(start),),)
    return Share(key, start, size, lo, hi, indices, mbs, scale)


def step_indices(plan: DataPlan, key: StepKey, order: Order | None = None) -> tuple[int, ...]:
    """Every sample of the step's global batch, in stream order (all participants' shares)."""
    order = order if order is not None else Order(plan.dataset_size, plan.seed, plan.shuffle)
    start, size = step_window(plan, key)
    return order.indices(start, start + size)


def next_key(plan: DataPlan, key: StepKey) -> StepKey:
    """The key of the data step after ``key`` if the quorum stays and the step commits.

    The loader reads ahead on this guess; a wrong guess costs a re-read, never a wrong batch.
    """
    if key.inner + 1 < plan.inner_steps:
        return StepKey(key.step, key.participants, key.rank, key.inner + 1, key.batches_committed)
    return StepKey(
        key.step + 1, key.participants, key.rank, 0, key.batches_committed + key.participants
    )
