"""The chaos soak of ``bench/chaos.py``, for 40 seconds: faults of every kind, nothing lost.

3 replica groups of 2 ranks (real processes, Gloo, fault-tolerant DDP, ``min_replica_size=1``)
against a lighthouse at the reference's defaults (heartbeat timeout 5 s); every 4-10 s a group
is SIGKILLed (one rank; the group is ended and restarted as torchrun would), SIGSTOPped for
2-8 s, or has its lighthouse path stalled for 6-10 s. The kinds come in a shuffled cycle, so a
40 s soak injects each kind at least once (seed 12: each twice). Asserted (the bench's own
checks, no timings): no process hung or died unplanned, every group ends bit-identical, every
committed step was committed in one quorum with one divisor and the steps are 0..N-1 (but for a
stale re-run that was healed over, see ``check_history``), the ranks of each group committed
the same steps, no committed step went back (data lost 0).

Each step sleeps 50 ms (standing for accelerator time) so six ranks stay light on two cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import ChaosConfig, run_soak, table

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_chaos_soak_loses_nothing(tmp_path: Path) -> None:
    config = ChaosConfig(
        duration_s=40.0, gap_s=(4.0, 10.0), seed=12, compute_s=0.05, workdir=tmp_path
    )
    result = run_soak(config)
    report = table(result)
    print(report)
    assert not result.problems, report
    assert {f.kind for f in result.faults} == {"kill", "stop", "cut"}, report
    assert all(f.back_s is not None for f in result.faults), report
    assert sum(f.data_lost for f in result.faults) == 0, report
    assert result.steps > 0
