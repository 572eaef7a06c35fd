"""Environment configuration, timeout budget and the pure per-step rules."""

from __future__ import annotations

from datetime import timedelta

import pytest

from torchheal._base.manager_env import EnvConfig
from torchheal._base.manager_timeouts import (
    ManagerTimeouts,
    get_timeout,
    timeout_budget_problems,
)
from torchheal.coordination.plan import Participation, WorldSizeMode, participation
from torchheal.coordination.types import QuorumResult
from torchheal.coordination.vote import local_vote, retry_limit_error

S = timedelta(seconds=1)


def test_torchheal_names_beat_torchft_names() -> None:
    env = EnvConfig.from_env(
        {
            "TORCHHEAL_TIMEOUT_SEC": "7",
            "TORCHFT_TIMEOUT_SEC": "99",
            "TORCHFT_QUORUM_TIMEOUT_SEC": "120",
            "TORCHFT_CONNECT_TIMEOUT_SEC": "3",
            "TORCHFT_QUORUM_RETRIES": "2",
            "TORCHHEAL_MANAGER_PORT": "1234",
            "TORCHFT_MANAGER_PORT": "4321",
            "TORCHFT_LIGHTHOUSE": "http://lh:29510",
        }
    )
    assert env == EnvConfig(
        lighthouse="http://lh:29510",
        manager_port=1234,
        timeout_sec=7,
        quorum_timeout_sec=120,
        connect_timeout_sec=3,
        quorum_retries=2,
    )
    resolved = ManagerTimeouts.resolve(env, 60 * S, 60 * S, 60 * S, 0)
    assert resolved == ManagerTimeouts(7 * S, 120 * S, 3 * S, 2)


def test_unset_environment_keeps_arguments() -> None:
    env = EnvConfig.from_env({})
    assert env == EnvConfig()
    resolved = ManagerTimeouts.resolve(env, 5 * S, 9 * S, 2 * S, 1)
    assert resolved == ManagerTimeouts(5 * S, 9 * S, 2 * S, 1)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TORCHHEAL_TIMEOUT_SEC", "ten"),
        ("TORCHFT_QUORUM_TIMEOUT_SEC", "1.5"),
        ("TORCHFT_CONNECT_TIMEOUT_SEC", "0"),
        ("TORCHHEAL_QUORUM_RETRIES", "-1"),
        ("TORCHFT_MANAGER_PORT", "70000"),
    ],
)
def test_malformed_value_names_the_variable(name: str, value: str) -> None:
    with pytest.raises(ValueError, match=name):
        EnvConfig.from_env({name: value})


def test_get_timeout() -> None:
    assert get_timeout(None, 3 * S) == 3 * S
    assert get_timeout("10", 3 * S) == 10 * S
    with pytest.raises(ValueError, match="abc"):
        get_timeout("abc", 3 * S)


def test_timeout_budget() -> None:
    sound = ManagerTimeouts(30 * S, 60 * S, 10 * S, 0)
    assert timeout_budget_problems(sound, timedelta(milliseconds=100)) == []
    bad = ManagerTimeouts(60 * S, 2 * S, 10 * S, 0)
    problems = timeout_budget_problems(bad, 6 * S)
    assert len(problems) == 3
    assert "quorum_timeout (0:00:02) < timeout (0:01:00)" in problems[0]
    assert "heartbeat expiry (0:00:05)" in problems[1]
    assert "heartbeat_interval (0:00:06)" in problems[2]
    with pytest.raises(ValueError, match="quorum_timeout"):
        ManagerTimeouts.resolve(EnvConfig(), S, timedelta(0), S, 0)


def _result(**kw: object) -> QuorumResult:
    base = dict(
        replica_rank=2,
        replica_world_size=3,
        max_replica_rank=1,
        max_world_size=2,
    )
    base.update(kw)
    return QuorumResult(**base)  # type: ignore[arg-type]


def test_participation_rules() -> None:
    dyn = WorldSizeMode.DYNAMIC
    # Async quorum or no healing: only up-to-date replicas contribute.
    assert participation(_result(), True, True, dyn, 1) == Participation(1, 2)
    assert participation(_result(), False, False, dyn, 1) == Participation(1, 2)
    # Sync quorum with healing: everyone.
    assert participation(_result(), False, True, dyn, 1) == Participation(2, 3)
    assert participation(_result(max_replica_rank=None), True, True, dyn, 1) == Participation(
        None, 2
    )
    # Fixed with spares: rank 2 of 3 with min 2 is a spare; participants capped at 2.
    spares = WorldSizeMode.FIXED_WITH_SPARES
    r = _result(max_replica_rank=2, max_world_size=3)
    assert participation(r, True, True, spares, 2) == Participation(None, 2)
    assert participation(
        _result(max_replica_rank=1, max_world_size=3), True, True, spares, 2
    ) == Participation(1, 2)


def test_commit_rules() -> None:
    assert local_vote(2, 2, errored=False)
    assert not local_vote(1, 2, errored=False)
    assert not local_vote(3, 2, errored=True)
    assert retry_limit_error(2, 2) is None
    assert retry_limit_error(5, None) is None
    assert retry_limit_error(3, 2) == (
        "should_commit failed 3 times consecutively, exceeding max_retries=2"
    )


def test_every_other_reader_of_the_environment() -> None:
    from torchheal._base.launch_env import LauncherEnv
    from torchheal._base.manager_env import salvage_step, use_bucketization, watchdog_timeout_s
    from torchheal._base.security import checkpoint_token
    from torchheal._base.telemetry_env import nccl_debug_pipe_prefix

    assert watchdog_timeout_s({}) == 30.0
    assert watchdog_timeout_s({"TORCHFT_WATCHDOG_TIMEOUT_SEC": "2.5"}) == 2.5
    with pytest.raises(ValueError, match="TORCHHEAL_WATCHDOG_TIMEOUT_SEC"):
        watchdog_timeout_s({"TORCHHEAL_WATCHDOG_TIMEOUT_SEC": "-1"})
    assert use_bucketization({"TORCHFT_USE_BUCKETIZATION": "True"})
    assert not use_bucketization({"TORCHHEAL_USE_BUCKETIZATION": "1"})  # only "True", as ref
    assert not salvage_step({})
    assert salvage_step({"TORCHHEAL_SALVAGE_STEP": "1"})
    with pytest.raises(ValueError, match="TORCHHEAL_SALVAGE_STEP must be 0 or 1"):
        salvage_step({"TORCHHEAL_SALVAGE_STEP": "yes"})
    assert checkpoint_token({"TORCHHEAL_CHECKPOINT_TOKEN": ""}) is None
    assert nccl_debug_pipe_prefix({"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/tmp/fr"}) == "/tmp/fr"
    assert LauncherEnv.from_env({}) == LauncherEnv()
    got = LauncherEnv.from_env({"REPLICA_GROUP_ID": "2", "NUM_REPLICA_GROUPS": "3"})
    assert (got.replica_group_id, got.num_replica_groups) == (2, 3)
    assert not got.warm_spare
    assert LauncherEnv.from_env({"TORCHHEAL_WARM_SPARE": "1"}).warm_spare
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID"):
        LauncherEnv.from_env({"REPLICA_GROUP_ID": "x"})
