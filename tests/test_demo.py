"""``make demo`` itself, with short settings: a group is SIGKILLed, heals, and every group ends
with the same weights, as the workers' own digests show (not only the summary's verdict)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

DIGEST_LINE = re.compile(r"^\s+group (\d+): sha256 ([0-9a-f]{16})…$", re.M)


def test_make_demo_survives_a_kill_and_ends_bit_identical() -> None:
    venv = Path(sys.executable).parent.parent
    # -o: the venv running this test is set up already; never re-run the set-up from a test.
    command = [
        "make",
        "-s",
        "-o",
        str(venv / ".torchheal-installed"),
        "demo",
        f"VENV={venv}",
        # Survivors keep training ~12 s after the kill, so the victim restarts (1 s down plus
        # its start-up) while they still run, even on a slow, busy machine.
        "DEMO_ARGS=--replicas 3 --steps 80 --kill-at-step 4 --step-delay 0.15",
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    out = done.stdout
    assert "*** killing group 1 with SIGKILL" in out, out[-3000:]
    assert "failures survived      1" in out, out[-3000:]
    assert "(healed live from a peer)" in out, out[-3000:]
    # The demo keeps a warm spare: the restart skips the interpreter and torch start-up.
    assert "group 1 started (pid " in out and ", from a warm spare)" in out, out[-3000:]
    assert "restarted group (a warm spare) committed after" in out, out[-3000:]
    digests = dict(DIGEST_LINE.findall(out))
    assert sorted(digests) == ["0", "1", "2"], f"one digest per group expected:\n{out[-3000:]}"
    # The verdict, checked against what the workers reported.
    same = len(set(digests.values())) == 1
    assert same, f"groups ended with different weights: {digests}"
    assert "identical weights      yes, bit-identical on every group" in out
    assert done.returncode == 0, done.stderr[-3000:]
