"""examples/train_diloco.py really runs: two replica groups under ``torchheal launch``.

Uses the launcher that ``torchheal launch --replicas 2 -- python examples/train_diloco.py``
runs, against a real lighthouse that needs both groups in every quorum, for three outer steps
of Streaming DiLoCo (2 fragments, sync_every 20, delay 1), and checks that both groups exit 0
having synced together.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from torchheal.coordination import LighthouseServer
from torchheal.launcher import Launcher

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_diloco.py"
STEPS = 3


def test_train_diloco_two_groups_under_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without torchrun's store variables the example hosts its own store, as under launch.
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=1000, heartbeat_timeout_ms=2000
    )
    output: list[tuple[int, str]] = []
    try:
        launcher = Launcher(
            [sys.executable, str(EXAMPLE)],
            replicas=2,
            lighthouse_addr=f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}",
            deadline_s=120,
            env={
                "STEPS": str(STEPS),
                "USE_STREAMING": "True",
                "OMP_NUM_THREADS": "1",
            },
            on_output=lambda g, line: output.append((g, line)),
        )
        result = launcher.run()
    finally:
        lighthouse.shutdown()

    log = "\n".join(f"[{g}] {line}" for g, line in output)
    assert not result.timed_out, log
    for group in (0, 1):
        assert result.groups[group].exit_codes == [0], log
        lines = [line for g, line in output if g == group]
        finished = [line for line in lines if "finished at outer step" in line]
        assert finished == [
            f"[group {group}] finished at outer step {STEPS} after {STEPS * 10} inner steps "
            "(last sync: 2 groups)"
        ], log
        syncs = [
            int(m.group(1)) for line in lines if (m := re.search(r"outer step (\d+) inner", line))
        ]
        assert syncs == list(range(1, STEPS + 1)), log
