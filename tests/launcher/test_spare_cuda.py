"""Warm spares on a GPU machine: a rank forked from the template uses CUDA as a cold start does,
and a preload that initializes CUDA (which no fork can use) makes the spares start fresh."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

from torchheal.launcher.spare import SparePool
from torchheal.launcher.spare_process import started_warm

pytestmark = pytest.mark.gpu

TIMEOUT = 120

# Puts a tensor on the GPU, reduces it there and reports the result with its device.
USES_CUDA = (
    "import json, torch\n"
    "x = torch.arange(8.0, device='cuda') * 2\n"
    "print(json.dumps({'sum': x.sum().item(), 'device': str(x.device)}), flush=True)\n"
)


def _run_in_spare(tmp_path: Path, preload: list[str]) -> tuple[dict, bool]:
    (tmp_path / "uses_cuda.py").write_text(USES_CUDA)
    env = dict(os.environ)
    with SparePool(
        [sys.executable, "unused.py"], 1, env=env, cwd=str(tmp_path), preload=preload, fork=True
    ) as pool:
        pool.fill()
        assert pool.wait_ready(TIMEOUT)
        forked = pool.template_pid is not None
        proc = pool.spawn([sys.executable, "uses_cuda.py"], env, str(tmp_path))
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert started_warm(proc) and proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1]), forked


def test_a_rank_forked_from_the_template_uses_cuda(tmp_path: Path) -> None:
    report, forked = _run_in_spare(tmp_path, ["torch"])
    assert forked, "the template that imported torch was not used"
    assert report == {"sum": 56.0, "device": "cuda:0"}


def test_a_preload_that_initializes_cuda_makes_the_spares_start_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "cuda_init.py").write_text("import torch\ntorch.cuda.init()\n")
    with caplog.at_level(logging.WARNING, logger="torchheal.launcher.spare"):
        report, forked = _run_in_spare(tmp_path, ["cuda_init"])
    assert not forked
    assert report == {"sum": 56.0, "device": "cuda:0"}
    assert "warm spares start fresh, not forked" in caplog.text and "CUDA" in caplog.text
