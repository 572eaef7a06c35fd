"""A trainer's ``/metrics``: real HTTP, the exposition Prometheus scrapes, counters that move."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest

from torchheal.metrics.trainer import TrainerStats, serve_metrics


def scrape(url: str) -> dict[str, float]:
    """``{series: value}`` of a Prometheus text exposition (comments skipped)."""
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


def test_trainer_metrics_are_served_and_move() -> None:
    stats = TrainerStats()
    server = serve_metrics(stats, "train_ddp_1", port=0, host="127.0.0.1")
    try:
        url = server.url("127.0.0.1")
        before = scrape(url)
        label = '{replica_id="train_ddp_1"}'
        assert before[f"torchheal_trainer_steps_committed_total{label}"] == 0.0
        assert before[f"torchheal_trainer_quorum_id{label}"] == -1.0
        assert "process_cpu_seconds_total" in before  # the process's own metrics too

        stats.steps_committed += 3
        stats.steps_failed += 1
        stats.heals += 1
        stats.heal_bytes += 4096
        stats.heal_seconds.observe(0.3)
        stats.quorum_seconds.observe(0.002)
        stats.quorum_wait_seconds += 0.5
        stats.count_error()
        stats.count_error(allreduce=True)
        stats.quorum_id, stats.quorum_size, stats.participants = 7, 3, 2
        after = scrape(url)
        assert after[f"torchheal_trainer_steps_committed_total{label}"] == 3.0
        assert after[f"torchheal_trainer_steps_failed_total{label}"] == 1.0
        assert after[f"torchheal_trainer_heals_total{label}"] == 1.0
        assert after[f"torchheal_trainer_heal_bytes_total{label}"] == 4096.0
        assert after[f"torchheal_trainer_quorum_wait_seconds_total{label}"] == 0.5
        assert after[f"torchheal_trainer_errors_total{label}"] == 1.0
        assert after[f"torchheal_trainer_allreduce_errors_total{label}"] == 1.0
        assert after[f"torchheal_trainer_quorum_id{label}"] == 7.0
        assert after[f"torchheal_trainer_quorum_size{label}"] == 3.0
        assert after[f"torchheal_trainer_participants{label}"] == 2.0
        heal = 'torchheal_trainer_heal_duration_seconds_bucket{le="0.5",replica_id="train_ddp_1"}'
        assert after[heal] == 1.0
        assert after[f"torchheal_trainer_heal_duration_seconds_count{label}"] == 1.0
        assert after[f"torchheal_trainer_quorum_duration_seconds_sum{label}"] == pytest.approx(
            0.002
        )
        # Prometheus conventions: counters end in _total, durations are in seconds.
        for name in after:
            metric = re.sub(r"\{.*", "", name)
            if metric.startswith("torchheal_trainer_") and "seconds" in metric:
                assert re.search(r"_seconds(_total|_bucket|_sum|_count)?$", metric), metric
    finally:
        server.shutdown()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)


def test_a_busy_metrics_port_is_a_clear_error() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot serve /metrics on 127.0.0.1:{port}"):
            serve_metrics(TrainerStats(), "g", port=port, host="127.0.0.1")
    finally:
        taken.close()
