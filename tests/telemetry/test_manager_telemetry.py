"""Real Managers report: the structured records with the reference's fields, and ``/metrics``
counters that move with commits, failed steps, an allreduce error and a heal."""

from __future__ import annotations

import logging
import re
import time
import urllib.request

import pytest
import torch

from tests.cluster import TIMEOUT, lighthouse, replica, run_parallel
from torchheal.process_group import FakeProcessGroupWrapper, ProcessGroupGloo

LABEL = re.compile(r'\{replica_id="([^"]+)"\}')


def scrape(port: int) -> dict[str, float]:
    """``{metric name: value}`` of one trainer's ``torchheal_trainer_*`` series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("torchheal_trainer_") and "_bucket" not in line:
            series, _, value = line.rpartition(" ")
            values[LABEL.sub("", series)] = float(value)
    return values


def step(r, fail: bool = False) -> bool:
    r.manager.start_quorum()
    if fail:
        r.pg.report_future_error(RuntimeError("injected allreduce failure"))
    r.manager.allreduce(torch.ones(3)).wait()
    return r.manager.should_commit()


def test_managers_write_records_and_move_their_metrics(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("JOB_ID", "job-7")
    monkeypatch.setenv("TORCHHEAL_METRICS_PORT", "0")
    monkeypatch.setenv("TORCHHEAL_METRICS_HOST", "127.0.0.1")
    for name in ("torchft_quorums", "torchft_commits", "torchheal.manager"):
        caplog.set_level(logging.INFO, logger=name)

    with (
        lighthouse(min_replicas=2, join_timeout_ms=5000) as lh,
        replica(
            lh, "a", weight=1.0, pg=FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT))
        ) as a,
        replica(lh, "b", weight=2.0) as b,
    ):
        ports = {
            m.group(1): int(m.group(2))
            for m in (
                re.search(
                    r"\[(\w):[^\]]*\] Prometheus metrics at http://[^:]+:(\d+)/metrics",
                    rec.getMessage(),
                )
                for rec in caplog.records
            )
            if m
        }
        assert sorted(ports) == ["a", "b"], [r.getMessage() for r in caplog.records]
        assert scrape(ports["a"])["torchheal_trainer_steps_committed_total"] == 0.0

        assert run_parallel(
            lambda: [step(a) for _ in range(3)], lambda: [step(b) for _ in range(3)]
        ) == [
            [True] * 3,
            [True] * 3,
        ]
        # a's allreduce fails: a skips the step (b, whose allreduce went through, commits).
        assert run_parallel(lambda: step(a, fail=True), lambda: step(b)) == [False, True]
        # a's failed commit makes the lighthouse issue a new quorum id; a, a step behind, heals.
        assert run_parallel(lambda: step(a), lambda: step(b)) == [True, True]

        ma, mb = scrape(ports["a"]), scrape(ports["b"])

    assert ma["torchheal_trainer_steps_committed_total"] == 4.0
    assert ma["torchheal_trainer_steps_failed_total"] == 1.0
    assert ma["torchheal_trainer_allreduce_errors_total"] == 1.0
    assert ma["torchheal_trainer_errors_total"] >= 1.0
    assert mb["torchheal_trainer_steps_committed_total"] == 5.0
    assert mb["torchheal_trainer_steps_failed_total"] == 0.0
    assert mb["torchheal_trainer_allreduce_errors_total"] == 0.0
    for m in (ma, mb):
        assert m["torchheal_trainer_quorums_total"] == 5.0
        assert m["torchheal_trainer_quorum_duration_seconds_count"] == 5.0
        assert m["torchheal_trainer_reconfigurations_total"] == 2.0
        assert m["torchheal_trainer_quorum_size"] == 2.0
        assert "torchheal_trainer_quorum_wait_seconds_total" in m
    # Each group healed once and served once, 3 float32 weights (12 bytes) each time: b from a
    # at step 0 (init_sync; "a" sorts first, so it is the primary), a from b after its failed
    # step left it one step behind.
    for m in (ma, mb):
        assert m["torchheal_trainer_heals_total"] == 1.0
        assert m["torchheal_trainer_heal_bytes_total"] == 12.0
        assert m["torchheal_trainer_heal_duration_seconds_count"] == 1.0
        assert m["torchheal_trainer_heal_failures_total"] == 0.0
        assert m["torchheal_trainer_recovery_sends_total"] == 1.0
        assert m["torchheal_trainer_recovery_send_bytes_total"] == 12.0
    assert ma["torchheal_trainer_step"] == 5.0 and mb["torchheal_trainer_step"] == 5.0

    def records(logger: str, replica_id: str) -> list[dict]:
        keys = ("job_id", "replica_id", "rank", "quorum_id", "step", "commit_result")
        return [
            {k: getattr(r, k) for k in keys if hasattr(r, k)}
            for r in caplog.records
            if r.name == logger and r.replica_id == replica_id
        ]

    commits = records("torchft_commits", "a")
    assert [(c["step"], c["commit_result"]) for c in commits] == [
        (0, True),
        (1, True),
        (2, True),
        (3, False),
        (4, True),  # healed to b's step 4 first
    ]
    assert all(c["job_id"] == "job-7" and c["rank"] == 0 for c in commits)
    quorums = records("torchft_quorums", "a")
    assert [q["step"] for q in quorums] == [0, 4]  # the quorums' max step
    first, second = (q["quorum_id"] for q in quorums)
    assert second > first
    assert [c["quorum_id"] for c in commits] == [first] * 4 + [second]
    assert all(set(q) == {"job_id", "replica_id", "rank", "quorum_id", "step"} for q in quorums)
    assert all(r.getMessage() == "" for r in caplog.records if r.name.startswith("torchft_"))


def test_a_lost_member_aborts_the_group_counted_and_recorded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("JOB_ID", "job-8")
    monkeypatch.setenv("TORCHHEAL_METRICS_PORT", "0")
    monkeypatch.setenv("TORCHHEAL_METRICS_HOST", "127.0.0.1")
    caplog.set_level(logging.INFO, logger="torchft_errors")
    caplog.set_level(logging.INFO, logger="torchheal.manager")
    with lighthouse(min_replicas=1, join_timeout_ms=5000) as lh, replica(lh, "a") as a:
        port = a.manager._telemetry.server.port
        with replica(lh, "b") as b:
            assert run_parallel(lambda: step(a), lambda: step(b)) == [True, True]
        # b is gone: the lighthouse tells a, whose Manager aborts its cross-replica group.
        deadline = time.monotonic() + 20
        while scrape(port)["torchheal_trainer_process_group_aborts_total"] < 1:
            assert time.monotonic() < deadline, "the abort was never counted"
            time.sleep(0.05)
    errors = [r for r in caplog.records if r.name == "torchft_errors"]
    assert errors and errors[0].error == "process_group_abort" and errors[0].job_id == "job-8"
