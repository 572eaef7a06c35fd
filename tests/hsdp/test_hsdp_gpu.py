"""Fault-tolerant HSDP on CUDA: the same kill-and-heal scenario with the model on the GPU.

Each replica group is one rank (NCCL inside the group, world size 1) so two groups fit on a
single GPU; the cross-replica group is Gloo over CUDA tensors (two NCCL ranks may not share a
device). With more GPUs each rank gets its own device (rank modulo the GPUs present).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hsdp.jobs import load, run_ft_with_restart, tensors

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GROUPS = 2
STEPS = 4
KILL_AT = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    out = tmp_path_factory.mktemp("hsdp_gpu")
    run_ft_with_restart(
        out, GROUPS, 1, STEPS, kill_group=1, kill_at=KILL_AT, deadline_s=240, device="cuda"
    )
    return out


def test_gpu_group_heals_and_replicas_match(runs: Path) -> None:
    survivor, healed = load(runs / "ft_g0_r0.pt"), load(runs / "ft_g1_r0.pt")
    assert survivor["step"] == healed["step"] == STEPS
    assert healed["healed"] == [KILL_AT]
    a, b = tensors(survivor), tensors(healed)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
