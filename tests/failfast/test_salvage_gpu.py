"""Salvaging the step in flight with the model on the GPU (``test_salvage``'s job on CUDA).

Each allreduce's input is kept by a device copy into a buffer on the GPU, and the redo replays
from those buffers into the CUDA gradients. The groups share one GPU, so they talk through Gloo
over CUDA tensors. The end state is compared with the CPU replay of the committed history, to
float32 tolerance (other kernels round otherwise), and across groups bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.failfast.test_salvage import salvage_a_lost_group

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(300)]


def test_survivors_commit_the_step_a_group_died_in_on_cuda(tmp_path: Path) -> None:
    salvage_a_lost_group(tmp_path, "cuda")
