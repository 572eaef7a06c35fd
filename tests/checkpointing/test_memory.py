"""Fresh staging buffers come with their pages already faulted in (one system call)."""

import os
import sys

import pytest
import torch

from torchheal.checkpointing._memory import empty_populated, populate


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_a_populated_buffer_is_resident_before_it_is_written() -> None:
    nbytes = 64 << 20
    before = _resident_bytes()
    buf = empty_populated(nbytes)
    grown = _resident_bytes() - before
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    if (major, minor) < (5, 14):  # pragma: no cover - the call is refused, nothing breaks
        assert grown < nbytes // 2
    else:
        assert grown >= nbytes * 0.9
    buf.fill_(3)  # an ordinary, usable buffer
    assert int(buf[-1]) == 3


def test_small_or_non_cpu_buffers_are_left_alone() -> None:
    assert not populate(torch.empty(1000, dtype=torch.uint8))
    assert not populate(torch.empty(0, dtype=torch.uint8))
