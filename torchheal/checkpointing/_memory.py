"""Fresh host buffers with their pages already there.

Writing into fresh memory faults page by page, which dominates on a virtual machine; Linux's
``MADV_POPULATE_WRITE`` (5.14+) faults a whole range in one call (``docs/failures.md``).
Where it is missing buffers are used as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

__all__ = ["empty_populated", "populate"]

_MADV_POPULATE_WRITE = 23
_PAGE = 4096
#: Smaller buffers are not worth a system call.
_MIN_BYTES = 1 << 20

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # pragma: no cover - a libc without madvise
        _madvise = None
_supported = _madvise is not None


def populate(buf: torch.Tensor) -> bool:
    """Faults in the whole pages of a contiguous CPU tensor now, in one system call.

    Returns whether the kernel did it (False: unsupported here, or too small to bother).
    """
    global _supported
    nbytes = buf.numel() * buf.element_size()
    if not _supported or buf.device.type != "cpu" or nbytes < _MIN_BYTES:
        return False
    start = (buf.data_ptr() + _PAGE - 1) & ~(_PAGE - 1)
    end = (buf.data_ptr() + nbytes) & ~(_PAGE - 1)
    if end <= start:
        return False
    if _madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
        _supported = False  # EINVAL: a kernel before 5.14; don't ask again
        return False
    return True


def empty_populated(nbytes: int) -> torch.Tensor:
    """A 1-D ``uint8`` CPU buffer of ``nbytes`` whose pages are already faulted in."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    populate(buf)
    return buf
