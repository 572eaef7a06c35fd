"""Replica groups as threads of this process: a real lighthouse, real stores, real Managers.

Each group gets its own TCPStore (port 0) and runs :func:`workers.train_replica` on its own
thread. An injected failure raises :class:`InjectedFailure`; the group's manager and process
group are shut down (so its heartbeats stop and its peers see it gone) and the group is started
again as a new incarnation with a fresh model, which must heal from its peers. No process dies
here: that is ``test_kill_heal.py``'s job.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from torch.distributed import TCPStore

from tests.local_sgd_integ.workers import Faults, TrainConfig, train_replica
from torchheal.coordination import LighthouseServer


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
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=min_replicas,
        join_timeout_ms=100,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=500,
    )
    addr = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    progress = threading.Condition()
    group0_step = [0]

    def wait_group0(step: int) -> None:
        with progress:
            ok = progress.wait_for(lambda: group0_step[0] >= step, timeout=deadline_s)
        assert ok, f"group 0 never reached step {step}"

    def run_group(index: int, spec: GroupSpec) -> GroupOutcome:
        if spec.start_after_step is not None:
            wait_group0(spec.start_after_step)
        failures = 0
        while True:
            faults = spec.faults if failures == 0 else Faults()
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

            def fail(incarnation: int = failures) -> None:
                raise InjectedFailure(f"g{index} incarnation {incarnation}")

            try:
                state = train_replica(
                    cfg,
                    faults,
                    index,
                    failures,
                    addr,
                    store.port,
                    fail,
                    on_step=(lambda s: _publish(s)) if index == 0 else None,
                )
                return GroupOutcome(state, failures)
            except InjectedFailure:
                failures += 1
                assert failures <= max_restarts, f"g{index} failed {failures} times"
            finally:
                del store

    def _publish(step: int) -> None:
        with progress:
            group0_step[0] = step
            progress.notify_all()

    try:
        with ThreadPoolExecutor(max_workers=len(groups)) as pool:
            futures = [pool.submit(run_group, i, spec) for i, spec in enumerate(groups)]
            return [f.result(timeout=deadline_s) for f in futures]
    finally:
        lighthouse.shutdown()
