"""Staging a private copy for a heal: copied and checksummed in one pass, into reused buffers."""

import random
import zlib
from datetime import timedelta

import pytest
import torch

from tests.checkpointing.test_serialization import assert_same
from torchheal.checkpointing import CheckpointError, HTTPTransport
from torchheal.checkpointing._format import crc32
from torchheal.checkpointing.serialization import StagingPool, decode_bytes, stage

BLOCK = 4096
TIMEOUT = timedelta(seconds=10)


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(3 * BLOCK + 17),  # several blocks, a short last one
        "tied": [torch.arange(10), None],
        "step": 4,
    }


def _encoded(staged) -> bytes:  # type: ignore[no-untyped-def]
    parts = [staged.header, staged.description]
    staged.write_segments(lambda mv: parts.append(bytes(mv)), staged.segments)
    return b"".join(parts)


def test_crc32_is_zlibs_checksum() -> None:
    rng = random.Random(0)
    data = bytes(rng.getrandbits(8) for _ in range(100_000))
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[500:], crc32(data[:500])) == zlib.crc32(data)


def test_pooled_stage_is_a_private_copy_with_the_same_checksums() -> None:
    state = _state()
    original = {"w": state["w"].clone(), "tied": [state["tied"][0].clone(), None], "step": 4}
    by_reference = stage(state, 3, block_bytes=BLOCK)
    staged = stage(state, 3, block_bytes=BLOCK, pool=StagingPool())
    assert staged.description == by_reference.description  # same checksums, same layout
    state["w"].add_(1.0)  # the trainer goes on right after staging
    state["tied"][0].mul_(3)
    assert_same(decode_bytes(_encoded(staged)), original)


def test_pool_reuses_buffers_between_heals() -> None:
    pool = StagingPool()
    first = stage(_state(), 1, block_bytes=BLOCK, pool=pool)
    pointers = sorted(b.data_ptr() for b in first.buffers)
    pool.give_back(first.buffers)
    second = stage(_state(), 2, block_bytes=BLOCK, pool=pool)
    assert sorted(b.data_ptr() for b in second.buffers) == pointers
    assert pool.nbytes == 0  # all in use again


def test_a_refused_state_gives_its_buffers_back() -> None:
    pool = StagingPool()
    with pytest.raises(CheckpointError, match="cannot send"):
        stage({"w": torch.zeros(100), "bad": object()}, 1, block_bytes=BLOCK, pool=pool)
    assert pool.nbytes == 400


def test_http_serves_what_was_staged_not_what_changed_since() -> None:
    src = HTTPTransport(TIMEOUT, 0, hostname="localhost", block_bytes=BLOCK)
    dst = HTTPTransport(TIMEOUT, 0, hostname="localhost")
    try:
        state = _state()
        before = state["w"].clone()
        src.send_checkpoint([1], 7, state, TIMEOUT)
        src.disallow_checkpoint()  # the Manager's should_commit, before the optimizer step
        state["w"].fill_(-1.0)  # an optimizer step while the healer downloads
        out = dst.recv_checkpoint(0, src.metadata(), 7, TIMEOUT)
        assert torch.equal(out["w"], before)
        # The next heal copies into the same pages.
        pointers = sorted(b.data_ptr() for b in src._staged.private)
        src.send_checkpoint([1], 8, state, TIMEOUT)
        assert sorted(b.data_ptr() for b in src._staged.private) == pointers
        assert torch.equal(dst.recv_checkpoint(0, src.metadata(), 8, TIMEOUT)["w"], state["w"])
    finally:
        src.shutdown()
        dst.shutdown()
