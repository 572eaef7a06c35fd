"""LocalSGD/DiLoCo jobs whose replica groups are threads of this process (``tests/cluster.py``).

A real lighthouse, real stores, real Managers: each group gets its own TCPStore (port 0) and
runs :func:`workers.train_replica` on its own thread. An injected failure raises :class:`InjectedFailure`; the group's manager and process
group are shut down (so its heartbeats stop and its peers see it gone) and the group is started
again as a new incarnation with a fresh model, which must heal from its peers. No process dies
here: that is ``test_kill_heal.py``'s job.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from tests.cluster import lighthouse, new_store, run_groups_on_threads, url
from tests.local_sgd_integ.workers import Faults, TrainConfig, train_replica


class InjectedFailure(Exception):
    """A replica group's simulated crash."""


@dataclass(frozen=True)
class GroupSpec:
    """One replica group of a threaded run.

    Args:
        faults: failures injected into the first incarnation only.
        start_after_step: start only once group 0 has committed this manager step (upscale).
    """

    faults: Faults = field(default_factory=Faults)
    start_after_step: int | None = None


@dataclass
class GroupOutcome:
    """The final state of a group's last incarnation and how many times it failed."""

    state: dict[str, Any]
    failures: int


def run_threads(
    cfg: TrainConfig,
    groups: list[GroupSpec],
    *,
    min_replicas: int = 2,
    max_restarts: int = 2,
    deadline_s: float = 60.0,
) -> list[GroupOutcome]:
    """Run every group to completion on its own thread; raises the first group's error.

    Args:
        cfg: the shared training configuration.
        groups: one spec per replica group; group ``i`` is replica id ``g{i}``.
        min_replicas: the lighthouse's ``min_replicas``.
        max_restarts: injected failures tolerated per group.
        deadline_s: bound on the whole run.
    """
    progress = threading.Condition()
    group0_step = [0]

    def publish(step: int) -> None:
        with progress:
            group0_step[0] = step
            progress.notify_all()

    def wait_group0(step: int) -> None:
        with progress:
            ok = progress.wait_for(lambda: group0_step[0] >= step, timeout=deadline_s)
        assert ok, f"group 0 never reached step {step}"

    with lighthouse(
        min_replicas=min_replicas,
        join_timeout_ms=100,
        quorum_tick_ms=20,
        # The reference's default: every group shares this process (and its GIL) with the
        # lighthouse, so a stall of the whole process on a loaded machine must not read as every
        # group's death. A group that ends is seen at once anyway, by its session's end.
        heartbeat_timeout_ms=5000,
    ) as lh:

        def run_group(index: int, incarnation: int) -> dict[str, Any]:
            spec = groups[index]
            if incarnation == 0 and spec.start_after_step is not None:
                wait_group0(spec.start_after_step)
            faults = spec.faults if incarnation == 0 else Faults()
            store = new_store()

            def fail() -> None:
                raise InjectedFailure(f"g{index} incarnation {incarnation}")

            try:
                return train_replica(
                    cfg,
                    faults,
                    index,
                    incarnation,
                    url(lh),
                    store.port,
                    fail,
                    on_step=publish if index == 0 else None,
                )
            finally:
                del store

        outcomes = run_groups_on_threads(
            run_group,
            len(groups),
            restart_on=InjectedFailure,
            max_restarts=max_restarts,
            deadline_s=deadline_s,
        )
    return [GroupOutcome(state, failures) for state, failures in outcomes]
