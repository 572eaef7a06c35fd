"""BlockVerifier: overlapped checks catch every bad block and never outlive the buffers."""

import zlib

import pytest
import torch

from torchheal.checkpointing import CheckpointError
from torchheal.checkpointing._format import Segment, byte_view
from torchheal.checkpointing._verify import BlockVerifier


def _blocks(buf: torch.Tensor, block: int) -> list[Segment]:
    view = byte_view(buf)
    return [
        Segment(0, i, min(i + block, len(view)), zlib.crc32(view[i : i + block]))
        for i in range(0, len(view), block)
    ]


def test_good_blocks_pass() -> None:
    buf = torch.randint(0, 256, (100_000,), dtype=torch.uint8)
    with BlockVerifier(workers=2) as verifier:
        for seg in _blocks(buf, 8192):
            verifier.submit(byte_view(buf), seg)


def test_bad_block_raises_on_exit_or_next_submit() -> None:
    buf = torch.randint(0, 256, (100_000,), dtype=torch.uint8)
    segs = _blocks(buf, 8192)
    buf[50_000] ^= 1  # inside block 6
    with pytest.raises(CheckpointError, match=r"checksum mismatch in storage 0 bytes \[49152"):
        with BlockVerifier(workers=1) as verifier:
            for seg in segs:
                verifier.submit(byte_view(buf), seg)


def test_exit_on_error_waits_for_pending_checks() -> None:
    buf = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8)
    segs = _blocks(buf, 1 << 16)
    verifier = BlockVerifier(workers=1)
    with pytest.raises(ValueError, match="reader failed"):
        with verifier:
            for seg in segs:
                verifier.submit(byte_view(buf), seg)
            raise ValueError("reader failed")
    assert all(f.done() for f in verifier._futures)  # nothing still reads the buffer
