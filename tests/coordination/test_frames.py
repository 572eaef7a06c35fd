"""``rpc/frames.FrameReader`` on plain bytes: limits, any split, what an unfinished frame holds."""

from __future__ import annotations

import tracemalloc

import pytest

from torchheal.coordination.rpc.frames import FrameError, FrameReader, frame


def test_messages_come_out_whole_whatever_the_split() -> None:
    messages = [b"", b"a", b"b" * 127, b"c" * 128, b"d" * 70_000]
    stream = b"".join(frame(m) for m in messages)
    for step in (1, 2, 3, 127, 4096, len(stream)):
        reader = FrameReader(1 << 20)
        out = []
        for i in range(0, len(stream), step):
            out += reader.feed(stream[i : i + step])
        assert out == messages, step
        assert reader.pending == 0


def test_the_first_frame_has_its_own_limit_and_later_ones_the_full_one() -> None:
    reader = FrameReader(1000, first_frame=10)
    # A short first frame and a long second one in the same read: each meets its own limit.
    assert reader.feed(frame(b"h" * 10) + frame(b"q" * 900)) == [b"h" * 10, b"q" * 900]
    with pytest.raises(FrameError, match="frame of 1001 bytes is over the limit of 1000"):
        reader.feed(frame(b"x" * 1001))
    # Refused at its length: nothing of the long first frame is waited for.
    with pytest.raises(FrameError, match="first frame of 11 bytes is over the limit of 10"):
        FrameReader(1000, first_frame=10).feed(frame(b"x" * 11)[:2])


def test_a_frame_sent_in_small_pieces_holds_about_its_own_size() -> None:
    # A stranger drips an unfinished frame in two-byte reads (one-byte ones are shared objects):
    # what the reader holds must be the bytes, not an object per read.
    size = 64 * 1024
    data = frame(b"z" * size)
    short = (len(data) - 1) // 2 * 2  # all but the last byte or two
    reader = FrameReader(1 << 20)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(0, short, 2):
            assert reader.feed(data[i : i + 2]) == []
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert reader.pending == short
    assert held < 2 * size, held
    assert reader.feed(data[reader.pending :]) == [b"z" * size]
    assert reader.pending == 0
