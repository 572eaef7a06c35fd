"""DiLoCo reproduces the reference's recorded parameter histories exactly.

Scenario (tests/local_sgd/fixtures/README.md): two one-rank replica groups, a model of
``n_fragments`` 1x1 linear layers starting at 1.0, gradient constant 2.0, inner SGD lr 1,
one outer SGD lr 2 per fragment, ``sync_every`` 6, synchronous quorum. The replica groups run
on threads around an in-process cluster stand-in for the lighthouse/manager (quorum
rendezvous, healing from an up-to-date peer, averaging allreduce).

The healthy runs stop at manager step 5 and the recovery run at step 7: that is what the
recorded histories contain (16 and 22 local steps), although the README says 7 for both.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.local_sgd.fake_manager import ClusterManager, FakeCluster
from torchheal.local_sgd import DiLoCo

FIXTURES = Path(__file__).parent / "fixtures"
PREFIX = "torchft.diloco_regression_test.DiLoCoMockedUpdateTest."
SYNC_EVERY = 6
N_FRAGMENTS = 2

# file suffix -> (fragment_sync_delay, fragment_update_alpha), from the fixtures' README
UPDATE_CASES = {
    0: (0, 0.0),
    1: (0, 0.5),
    2: (0, 1.0),
    3: (1, 0.0),
    4: (1, 0.5),
    5: (1, 1.0),
}


class InjectedFailure(Exception):
    """Raised by a replica to simulate its crash; the runner restarts it in place."""


class Layers(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1, 1, bias=False) for _ in range(n))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.fill_(1.0)


def _train_once(
    cluster: FakeCluster,
    replica_id: str,
    delay: int,
    alpha: float,
    stop_step: int,
    fail_at_step: int | None,
) -> dict[str, Any]:
    model = Layers(N_FRAGMENTS)
    manager = ClusterManager(cluster, replica_id)
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outers = [torch.optim.SGD(layer.parameters(), lr=2.0) for layer in model.layers]
    history: dict[str, Any] = {}
    global_history: dict[str, Any] = {}
    seen_steps: set[int] = set()
    with DiLoCo(
        manager,
        list(model.layers),
        inner,
        outers,
        sync_every=SYNC_EVERY,
        backup_device=torch.device("cpu"),
        fragment_sync_delay=delay,
        fragment_update_alpha=alpha,
    ) as diloco:
        local_step = 0
        while True:
            history[str(local_step)] = {n: p.tolist() for n, p in model.named_parameters()}
            step = manager.current_step()
            if step >= stop_step:
                break
            if step not in seen_steps:
                seen_steps.add(step)
                global_history[str(local_step)] = {
                    f"layers.{i}.{name}": t.tolist()
                    for i, fragment in enumerate(diloco._fragments)
                    for name, t in fragment.original_parameters.items()
                }
            for p in model.parameters():
                p.grad = torch.full_like(p, 2.0)
            inner.step()
            if fail_at_step is not None and manager.current_step() == fail_at_step:
                raise InjectedFailure(f"{replica_id} fails at step {fail_at_step}")
            local_step += 1
    return {"history": history, "global_parameter_history": global_history}


def _run_replica(
    cluster: FakeCluster,
    replica_id: str,
    delay: int,
    alpha: float,
    stop_step: int,
    fail_at_step: int | None = None,
) -> dict[str, Any]:
    try:
        return _train_once(cluster, replica_id, delay, alpha, stop_step, fail_at_step)
    except InjectedFailure:
        # Restart in place with fresh model, optimizers and manager (step 0); it heals.
        return _train_once(cluster, replica_id, delay, alpha, stop_step, None)


def _run_cluster(delay: int, alpha: float, stop_step: int, fail: dict[int, int]) -> list:
    cluster = FakeCluster(num_replicas=2)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [
            pool.submit(_run_replica, cluster, f"replica_{r}", delay, alpha, stop_step, fail.get(r))
            for r in range(2)
        ]
        return [[f.result(timeout=30)] for f in futures]


def _load(name: str) -> list:
    return json.loads((FIXTURES / f"{PREFIX}{name}.json").read_text())


@pytest.mark.parametrize("index", sorted(UPDATE_CASES))
def test_diloco_mocked_updates(index: int) -> None:
    delay, alpha = UPDATE_CASES[index]
    expected = _load(f"test_diloco_mocked_updates_{index}")
    actual = _run_cluster(delay, alpha, stop_step=5, fail={})
    assert actual == expected


def test_diloco_mocked_failure_recovery() -> None:
    expected = _load("test_diloco_mocked_failure_recovery_0")
    actual = _run_cluster(delay=0, alpha=0.0, stop_step=7, fail={1: 2})
    assert actual == expected
    # The healed replica ends with the survivor's weights and global weights.
    assert actual[1][0]["history"]["15"] == actual[0][0]["history"]["21"]
