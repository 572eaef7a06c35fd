"""ETTR of each way of training from per-event costs and a mean time between failures (pure).

ETTR (effective training time ratio) is the ideal time of the work done over the wall time it
took: the ideal is N steps of a failure-free job with no fault-tolerance or checkpoint cost. To
first order in (cost / MTBF), with failures arriving at rate 1/M over wall time:

* **checkpoint-and-restart**: a save of ``save_s`` every ``interval_s`` of compute (Young's
  interval ``sqrt(2 * save_s * M)`` unless given); each failure stops the whole job for
  ``restart_s`` (detection, teardown, start-up, load) and throws away the work since the last
  save, on average half an interval and a save. ETTR = (1 - lost / M) * interval / (interval + save).
* **per-step fault tolerance** (torchheal, the reference): each step costs ``step_s`` instead of the
  ideal; each failure stalls the survivors ``stall_s``, and the failed group is out for ``out_s``
  (restart, join, heal), during which the job trains on (groups - 1) / groups of its samples.
  ETTR over steps = ideal / step * (1 - stall / M); over samples (tokens) it is further multiplied
  by (1 - out / (M * groups)): on a cluster that is the honest measure, since a step without a
  group is a smaller step.

``wall_*`` give the same model as a time to N steps for a known count of failures, which is how it
is checked against the runs measured on one machine (``bench/versus.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CkptCosts:
    """Checkpoint-and-restart's costs.

    Args:
        step_s: one training step.
        save_s: one synchronous checkpoint save (the job waits for it).
        restart_s: a failure to the first step after the restart, redone steps not included.
    """

    step_s: float
    save_s: float
    restart_s: float


@dataclass(frozen=True)
class FtCosts:
    """A per-step fault-tolerant way's costs.

    Args:
        step_s: one failure-free step, fault-tolerance overhead included.
        stall_s: job time lost per failure (the survivors' detection and reconfiguration).
        out_s: a failure to the failed group's first commit again (its samples are missing).
        groups: replica groups in the job.
    """

    step_s: float
    stall_s: float
    out_s: float
    groups: int


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between two saves: sqrt(2 * save * MTBF)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def ckpt_lost_per_failure(c: CkptCosts, interval_s: float) -> float:
    """Wall time one failure costs: the restart, and on average half of an interval and a save."""
    return c.restart_s + (interval_s + c.save_s) / 2.0


def ettr_ckpt(
    c: CkptCosts, ideal_step_s: float, mtbf_s: float, interval_s: float | None = None
) -> float:
    """Checkpoint-and-restart's ETTR at ``mtbf_s`` (Young's interval unless ``interval_s``)."""
    tau = young_interval(c.save_s, mtbf_s) if interval_s is None else interval_s
    lost = ckpt_lost_per_failure(c, tau)
    return max(0.0, 1.0 - lost / mtbf_s) * tau / (tau + c.save_s) * ideal_step_s / c.step_s


def ettr_ft(c: FtCosts, ideal_step_s: float, mtbf_s: float, samples: bool = True) -> float:
    """A fault-tolerant way's ETTR at ``mtbf_s``, over samples (default) or over steps."""
    ettr = ideal_step_s / c.step_s * max(0.0, 1.0 - c.stall_s / mtbf_s)
    if samples:
        ettr *= max(0.0, 1.0 - c.out_s / (mtbf_s * c.groups))
    return ettr


def wall_ckpt(c: CkptCosts, steps: int, save_every: int, failures: int) -> float:
    """Predicted seconds from the first step to step ``steps`` with ``failures`` failures."""
    saves = (steps - 1) // save_every if save_every else 0
    interval = save_every * c.step_s if save_every else 0.0
    return (steps - 1) * c.step_s + saves * c.save_s + failures * ckpt_lost_per_failure(c, interval)


def wall_ft(c: FtCosts, steps: int, failures: int) -> float:
    """Predicted seconds from the first step to step ``steps`` with ``failures`` failures."""
    return (steps - 1) * c.step_s + failures * c.stall_s


# ---------------------------------------------------------------------------------------------
# Cluster scale


@dataclass(frozen=True)
class Scale:
    """A cluster size and its mean time to a job-interrupting failure.

    Args:
        gpus: GPUs in the job.
        mtbf_s: mean time between failures of the whole job.
    """

    gpus: int
    mtbf_s: float


#: Llama 3 reliability study (Meta, 2024): ~7.9 h at 1,024 GPUs, 1.8 h at 16,384, ~14 min at 131,072.
PUBLISHED = (Scale(1024, 7.9 * 3600), Scale(16384, 1.8 * 3600), Scale(131072, 14 * 60))


@dataclass(frozen=True)
class Cluster:
    """Assumed properties of the job at scale (none is measured on this machine).

    Args:
        params: model parameters.
        bytes_per_param: training state per parameter (bf16 weights, fp32 master, Adam moments).
        group_gpus: GPUs per replica group (one HSDP shard group).
        step_s: one ideal training step at scale.
        ckpt_gbps: aggregate checkpoint write and read bandwidth, GB/s (one replica's state is
            written: the groups hold the same).
        heal_gbps: per-GPU bandwidth of a live heal, GB/s (each GPU of the new group receives its
            shard from its counterpart, all in parallel).
        relaunch_s: rescheduling the ranks and building their communicators at scale, paid by a
            whole-job restart and by a cold group restart, not by a warm spare.
    """

    params: float = 70e9
    bytes_per_param: float = 16.0
    group_gpus: int = 64
    step_s: float = 4.0
    ckpt_gbps: float = 2000.0
    heal_gbps: float = 25.0
    relaunch_s: float = 120.0

    @property
    def state_gb(self) -> float:
        return self.params * self.bytes_per_param / 1e9


@dataclass(frozen=True)
class MeasuredFt:
    """A fault-tolerant way's costs measured on this machine, carried to scale as they are.

    Args:
        overhead_s: per-step cost over the ideal step (seconds, held constant at scale).
        stall_s: job time lost per failure.
        out_s: a failure to the failed group's first commit (start-up, join, heal of a small state).
        warm: restarts in a warm spare (no relaunch at scale).
    """

    overhead_s: float
    stall_s: float
    out_s: float
    warm: bool


def at_scale_ckpt(cl: Cluster, restart_fixed_s: float, scale: Scale) -> tuple[float, float]:
    """(ETTR, interval s) of checkpoint-and-restart at ``scale``; ``restart_fixed_s`` is the
    measured restart less its load (detection, teardown, start-up)."""
    save = cl.state_gb / cl.ckpt_gbps
    restart = restart_fixed_s + cl.relaunch_s + cl.state_gb / cl.ckpt_gbps
    c = CkptCosts(cl.step_s, save, restart)
    return ettr_ckpt(c, cl.step_s, scale.mtbf_s), young_interval(save, scale.mtbf_s)


def at_scale_ft(cl: Cluster, m: MeasuredFt, scale: Scale, samples: bool = True) -> float:
    """ETTR of a fault-tolerant way at ``scale``."""
    heal = cl.state_gb / cl.group_gpus / cl.heal_gbps
    out = m.out_s + heal + (0.0 if m.warm else cl.relaunch_s)
    c = FtCosts(cl.step_s + m.overhead_s, m.stall_s, out, max(1, scale.gpus // cl.group_gpus))
    return ettr_ft(c, cl.step_s, scale.mtbf_s, samples)
