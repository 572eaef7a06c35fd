"""RWLock: shared readers, exclusive writer, bounded waits with TimeoutError."""

import threading

import pytest

from torchheal.checkpointing.rwlock import RWLock


def test_w_locked_tracks_writer_only() -> None:
    lock = RWLock(timeout=1)
    assert not lock.w_locked()
    with lock.w_lock():
        assert lock.w_locked()
    assert not lock.w_locked()
    with lock.r_lock():
        assert not lock.w_locked()


def test_readers_share_and_block_writer() -> None:
    lock = RWLock(timeout=0.05)
    lock.r_acquire()
    lock.r_acquire()  # a second reader gets in while the first holds it
    with pytest.raises(TimeoutError, match=r"Timed out waiting for wlock after 0\.05"):
        lock.w_acquire()
    lock.r_release()
    with pytest.raises(TimeoutError, match="wlock"):
        lock.w_acquire()
    lock.r_release()
    lock.w_acquire()  # free once the last reader left
    lock.w_release()


def test_writer_blocks_reader_in_another_thread() -> None:
    lock = RWLock(timeout=0.05)
    lock.w_acquire()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            lock.r_acquire()
        except TimeoutError as e:
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    t.join(5)
    assert len(errors) == 1 and "Timed out waiting for rlock" in str(errors[0])
    # A reader released by another thread's writer release gets in.
    lock.w_release()
    with lock.r_lock():
        pass


def test_reader_waits_for_writer_release() -> None:
    lock = RWLock(timeout=5)
    lock.w_acquire()
    entered = threading.Event()

    def reader() -> None:
        with lock.r_lock():
            entered.set()

    t = threading.Thread(target=reader)
    t.start()
    assert not entered.wait(0.05)
    lock.w_release()
    assert entered.wait(5)
    t.join(5)


def test_mismatched_release_and_bad_timeout() -> None:
    lock = RWLock()
    with pytest.raises(RuntimeError):
        lock.r_release()
    with pytest.raises(RuntimeError):
        lock.w_release()
    with pytest.raises(ValueError):
        RWLock(timeout=-2)
