"""When a bench worker stops with ``--until-full`` (``bench/_worker.py``): a survivor trains on
past ``--steps`` until its killed peer has healed back in, so ``bench/recovery.py`` times a heal,
not a restart that found nobody left to heal from."""

from __future__ import annotations

import pytest

from bench import _worker
from bench._worker import FULL_COMMITS, UntilFull


def test_without_the_option_a_worker_stops_at_its_steps() -> None:
    until = UntilFull(None)
    until.committed(True, 1)
    assert not until.done(39, 40)
    assert until.done(40, 40)


def test_a_survivor_goes_on_until_its_peer_has_been_back_for_a_few_commits() -> None:
    until = UntilFull(2)
    for _ in range(10):
        until.committed(True, 2)
    until.committed(True, 1)  # the peer was killed: the survivor commits alone
    assert not until.done(40, 40)
    until.committed(False, 0)  # a failed step counts neither way
    for _ in range(FULL_COMMITS - 1):
        until.committed(True, 2)
        assert not until.done(41, 40)
    until.committed(True, 2)
    assert until.done(46, 40)


def test_a_peer_that_never_comes_back_does_not_hold_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    until = UntilFull(2)
    until.committed(True, 1)
    assert not until.done(40, 40)  # the grace starts
    monkeypatch.setattr(_worker, "UNTIL_FULL_GRACE_S", -1.0)
    assert until.done(41, 40)
