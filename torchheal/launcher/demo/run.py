"""``torchheal demo``: a lighthouse and three replica groups on this machine, one killed mid-run.

The survivors agree on a new quorum and keep training; the killed group is restarted, heals
live from a peer, and every group ends with bit-identical weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from torchheal._base.security import SecurityEnv
from torchheal.launcher import KillPlan, Launcher, RunResult, python_module_command
from torchheal.launcher.demo.summary import Summary, render, summarize
from torchheal.launcher.events import Event
from torchheal.launcher.lighthouse import LocalLighthouse


@dataclass(frozen=True)
class DemoConfig:
    """Knobs of the demo run.

    Args:
        replicas: number of replica groups.
        steps: the job trains until this step commits.
        kill_at_step: SIGKILL one group when the job reaches this step.
        step_delay_s: simulated compute per step.
        restart_delay_s: how long the killed group stays down.
        warm_spares: warm spares kept for the restart (0: restart cold, as torchrun would).
        heartbeat_timeout_ms: lighthouse heartbeat expiry.
        join_timeout_ms: how long the lighthouse waits for stragglers.
        deadline_s: abort the run after this long.
        dashboard_port: 0: any free port; None: 29511, else any free port.
        token: the job token the dashboard's kill action needs (None: open).
        metrics_port: group g's rank 0 serves ``/metrics`` on this port plus g (0: any free
            port; None: off).
        security: the lighthouse's token and TLS settings (None: from the environment).
        environ: the environment the groups start from (None: this process's).
    """

    replicas: int = 3
    # Under a minute on 2 cores, yet long enough to watch the kill and heal on the dashboard.
    steps: int = 300
    kill_at_step: int = 100
    step_delay_s: float = 0.1
    restart_delay_s: float = 1.0
    warm_spares: int = 1
    heartbeat_timeout_ms: int = 2000
    # Longer than a step: a straggler rule shorter than a step lets quorums flip-flop between
    # subsets of the groups, as in the reference (see docs/operations.md).
    join_timeout_ms: int = 1000
    deadline_s: float = 300.0
    dashboard_port: int | None = None
    token: str | None = None
    metrics_port: int | None = None
    security: SecurityEnv | None = None
    environ: Mapping[str, str] | None = None

    def validate(self) -> None:
        if self.replicas < 2:
            raise ValueError(f"the demo needs at least 2 replica groups, got {self.replicas}")
        if self.warm_spares < 0:
            raise ValueError(f"warm_spares must be >= 0, got {self.warm_spares}")
        if not 0 < self.kill_at_step < self.steps:
            raise ValueError(
                f"kill_at_step must be between 1 and steps-1, got {self.kill_at_step} of {self.steps}"
            )


WORKER = "torchheal.launcher.demo.worker"
_EXPECTED_DDP_WARNING = "find_unused_parameters=True was specified in DDP constructor"


def _is_quorum(quorum_id: object) -> bool:
    return isinstance(quorum_id, int) and quorum_id >= 0


class _Printer:
    """Turns events into the running commentary: quorum changes, heals, kills, progress."""

    def __init__(self, out: Callable[[str], None], t0: float) -> None:
        self._out = out
        self._t0 = t0
        self._last_progress = -1

    def _say(self, when: float, msg: str) -> None:
        self._out(f"[{when - self._t0:6.2f}s] {msg}")

    def event(self, e: Event) -> None:
        f = e.fields
        if e.kind == "start":
            how = ", from a warm spare" if f.get("warm") else ""
            self._say(e.time, f"group {e.group} started (pid {f.get('pid')}{how})")
        elif e.kind == "quorum" and _is_quorum(f.get("quorum_id")):
            # (-1: none. A group whose peers finished and left has none, for its last step.)
            self._say(
                e.time,
                f"group {e.group} joined quorum {f.get('quorum_id')} with {f.get('participants')} participating group(s)",
            )
        elif e.kind == "step" and f.get("healed"):
            self._say(
                e.time,
                f"group {e.group} healed live from a peer and committed step {f.get('step')}",
            )
        elif e.kind == "step" and not f.get("committed"):
            self._say(
                e.time,
                f"group {e.group} skipped a step (a peer failed mid-step); no update applied",
            )
        elif e.kind == "step":
            step = int(f.get("step", 0))
            if step // 10 > self._last_progress // 10 and step > self._last_progress:
                self._last_progress = step
                self._say(
                    e.time,
                    f"step {step:4d}  loss {f.get('loss')}  participants {f.get('participants')}  quorum {f.get('quorum_id')}",
                )
        elif e.kind == "done":
            self._say(e.time, f"group {e.group} finished at step {f.get('step')}")

    def kill(self, group: int, reason: str) -> None:
        self._say(time.time(), f"*** killing group {group} with SIGKILL ({reason}) ***")

    def output(self, group: int, line: str) -> None:
        if _EXPECTED_DDP_WARNING in line:
            return  # torchheal's DDP sets find_unused_parameters on purpose; see torchheal/ddp.py
        self._out(f"    group {group} | {line}")


def run_demo(
    config: DemoConfig | None = None,
    out: Callable[[str], None] = print,
    hold: Callable[[str], None] | None = None,
) -> tuple[RunResult, Summary]:
    """Run the demo and return the raw run and its summary.

    ``out`` takes the commentary, one line per call; ``hold`` is called with the dashboard's
    URL after the summary, before the lighthouse stops (``--keep-open`` waits there).
    """
    config = config or DemoConfig()
    config.validate()
    lighthouse = LocalLighthouse(
        min_replicas=1,
        join_timeout_ms=config.join_timeout_ms,
        heartbeat_timeout_ms=config.heartbeat_timeout_ms,
        dashboard_port=config.dashboard_port,
        token=config.token,
        security=config.security,
    )
    try:
        t0 = time.time()
        printer = _Printer(out, t0)
        out(f"dashboard: {lighthouse.dashboard_url}  (open it to watch the kill and the heal)")
        out(
            f"lighthouse listening on {lighthouse.address}; starting {config.replicas} replica "
            f"groups; group 1 will be killed with SIGKILL at step {config.kill_at_step}"
        )
        metrics = config.metrics_port
        if metrics:
            urls = ", ".join(
                f"http://127.0.0.1:{metrics + g}/metrics" for g in range(config.replicas)
            )
            out(f"trainer metrics: {urls}")
        launcher = Launcher(
            python_module_command(
                WORKER,
                "--steps",
                str(config.steps),
                "--step-delay",
                str(config.step_delay_s),
            ),
            replicas=config.replicas,
            lighthouse_addr=lighthouse.address,
            kill_plan=KillPlan(at_step=config.kill_at_step, victims=(1,), max_kills=1),
            restart_delay_s=config.restart_delay_s,
            warm_spares=config.warm_spares,
            spare_preload=(WORKER,),
            deadline_s=config.deadline_s,
            on_event=printer.event,
            on_output=printer.output,
            on_kill=printer.kill,
            status=lighthouse.status,
            group_env=lambda g: (
                {}
                if metrics is None
                else {
                    "TORCHHEAL_METRICS_PORT": str(metrics + g if metrics else 0),
                    "TORCHHEAL_METRICS_HOST": "127.0.0.1",
                }
            ),
            base_env=config.environ,
        )
        result = launcher.run()
        summary = summarize(result)
        out(render(summary))
        if result.timed_out:
            out(f"demo did not finish within {config.deadline_s:.0f}s")
        if result.error is not None:
            out(f"demo stopped: {result.error}")
        if hold is not None:
            hold(lighthouse.dashboard_url)
    finally:
        lighthouse.shutdown()
    return result, summary
