"""Two replica groups train end to end with a job token (from a file) and TLS everywhere.

Real processes on loopback: the lighthouse in the test, each group a spawned process that
inherits the job's settings. Group 1 starts while group 0 trains, heals from it over the HTTPS
checkpoint transport, and from then on both commit the same weights at every step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import Launch, lighthouse, supervise, url
from tests.security.conftest import TOKEN
from tests.security.workers import train


def test_two_groups_train_and_heal_with_token_and_tls(
    job_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_env(token=None, tls=True)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    monkeypatch.setenv("TORCHHEAL_TOKEN_FILE", str(token_file))
    with lighthouse(min_replicas=1, join_timeout_ms=100) as lh:
        assert lh.direct_port() == 0  # TLS: sessions on the encrypted gRPC stream
        supervise(
            lambda group, rank, incarnation, store_port: (
                train,
                (group, url(lh), store_port, str(tmp_path / f"g{group}.json")),
            ),
            [Launch(0), Launch(1, start_delay_s=1.0)],
            deadline_s=120,
            max_restarts=0,
        )
    g0, g1 = (json.loads((tmp_path / f"g{g}.json").read_text()) for g in (0, 1))
    assert g1["loads"], "group 1 never healed from group 0"
    assert g0["most"] == g1["most"] == 2
    together = sorted(set(g0["history"]) & set(g1["history"]))
    assert len(together) >= 3
    for step in together:
        assert g0["history"][step] == g1["history"][step], f"weights differ at step {step}"
