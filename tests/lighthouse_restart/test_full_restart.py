"""The lighthouse and every group restart, with no record but the groups' stores (issue 40, bug 3).

torchrun keeps a replica group's store across restarts of its ranks, with the keys of every
process group built on it under ``/torchft/{quorum_id}/``. A lighthouse restarted without a
state file, to which no group of its previous life reconnects, used to number quorums from 1
again: a build on a reused prefix found the old keys (one peer waited 20 s, 2 of 3 tries). Group
rank 0 records in the store the last quorum id it built for and reports it when it starts, so
the new lighthouse numbers its quorums above it.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from tests.cluster import lighthouse, new_store, url
from torchheal.manager import Manager
from torchheal.process_group.gloo import ProcessGroupGloo

TIMEOUT = timedelta(seconds=30)


def _train(lighthouse_url: str, store_port: int, steps: int) -> int:
    """A fresh process of group "a" (a new Manager on the same store): its quorum id."""
    weight = torch.zeros(3)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=lambda sd: weight.copy_(sd["w"]),
        state_dict=lambda: {"w": weight},
        min_replica_size=1,
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse_url,
        replica_id="a",
    )
    try:
        # A restarted group's first step may be its warm-up (not voted on).
        for _ in range(steps + 1):
            manager.start_quorum()
            manager.allreduce(torch.ones(3)).wait()
            manager.should_commit()
        assert manager.current_step() >= steps
        return manager._quorum_id
    finally:
        manager.shutdown(wait=False)


def test_ids_never_repeat_when_the_lighthouse_and_every_group_restart() -> None:
    store = new_store()  # torchrun's: it outlives the group's processes
    with lighthouse(min_replicas=1) as first:
        before = _train(url(first), store.port, 2)
    assert before >= 1
    with lighthouse(min_replicas=1) as second:  # no state file: it remembers nothing
        after = _train(url(second), store.port, 2)
    assert after > before, f"quorum id {after} after the restart, {before} before"
