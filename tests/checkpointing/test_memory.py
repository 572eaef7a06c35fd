"""Fresh staging buffers come with their pages already faulted in (one system call)."""

import ctypes
import os
import sys

import pytest
import torch

from torchheal.checkpointing._memory import empty_populated, populate


def _resident_bytes(t: torch.Tensor) -> int:
    """How much of ``t``'s memory is resident (``mincore`` on its pages): unlike the process's
    RSS, not moved by another thread freeing memory meanwhile."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    vec = ctypes.create_string_buffer((length + page - 1) // page)
    assert libc.mincore(start, length, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_a_populated_buffer_is_resident_before_it_is_written() -> None:
    nbytes = 64 << 20
    buf = empty_populated(nbytes)
    grown = _resident_bytes(buf)
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
