"""The chaos soak with bit flips (``bench/chaos.py --flip-every``), for 30 seconds.

The soak of ``test_chaos.py`` (3 groups of 2 ranks, kills, stops and control-plane cuts, less
often here), and every 6 s one bit of one parameter of one rank flips, chosen by the seed. The
ranks run the divergence guard every step under ``repair``. Asserted (the bench's own checks):
every flip was applied and reported by its rank's guard before any comparison found that rank's
state equal, the report names the flipped tensor, no mismatch was reported that no flip
explains, and the soak's usual promises hold, every group bit-identical at the end among them.
With the guard off (``check_interval=0``) every flip goes unreported and stays: red.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import ChaosConfig, run_soak, table

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_every_flipped_bit_is_reported_and_repaired(tmp_path: Path) -> None:
    config = ChaosConfig(
        duration_s=30.0,
        gap_s=(8.0, 16.0),
        seed=5,
        compute_s=0.05,
        workdir=tmp_path,
        flip_every_s=6.0,
    )
    result = run_soak(config)
    report = table(result)
    print(report)
    assert not result.problems, report
    assert len(result.flips) >= 2, report
    assert all(f.reported is not None and f.named and not f.missed for f in result.flips), report
    assert result.identical is True, report
