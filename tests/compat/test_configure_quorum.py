"""``ProcessGroup.configure``'s optional quorum keywords (newer reference versions pass them).

``quorum_id``, ``group_rank`` and ``group_world_size`` name the rebuilt c10d group
``torchft_{quorum_id}_rank_{group_rank % group_world_size}``; ``global_ranks`` is recorded as
the backend's global ranks. Two real Gloo members on a loopback TCPStore, one thread each.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from torchheal.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroupDummy,
    ProcessGroupGloo,
)
from torchheal.process_group.base import quorum_group_name

pytestmark = pytest.mark.timeout(60)
TIMEOUT = timedelta(seconds=10)


def _options(c10d_pg: Any) -> Any:
    return c10d_pg._get_backend(torch.device("cpu")).options


def _configure_pair(make: Any, prefix: str, **quorum: Any) -> list[Any]:
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pgs = [make(), make()]

    def one(rank: int) -> Any:
        extra = {k: v[rank] for k, v in quorum.items()}
        pgs[rank].configure(f"localhost:{store.port}/{prefix}", f"r{rank}", rank, 2, **extra)
        t = torch.tensor([float(rank + 1)])
        pgs[rank].allreduce([t], torch.distributed.ReduceOp.SUM).wait()
        return t.item()

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(one, [0, 1])) == [3.0, 3.0]
    return pgs


def test_quorum_keywords_name_the_group_and_record_global_ranks() -> None:
    pgs = _configure_pair(
        lambda: ProcessGroupGloo(timeout=TIMEOUT),
        "q5",
        quorum_id=[5, 5],
        group_rank=[1, 1],
        group_world_size=[2, 2],
        global_ranks=[[1, 3], [1, 3]],
    )
    for pg in pgs:
        options = _options(pg.parent)
        assert options.group_name == "torchft_5_rank_1"
        assert options.global_ranks_in_group == [1, 3]


def test_wrappers_pass_the_keywords_through() -> None:
    pgs = _configure_pair(
        lambda: ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT)),
        "q7",
        quorum_id=[7, 7],
        group_rank=[0, 0],
        group_world_size=[1, 1],
    )
    assert [_options(pg.parent.parent).group_name for pg in pgs] == ["torchft_7_rank_0"] * 2


def test_without_keywords_the_old_call_still_works_and_names_nothing() -> None:
    pgs = _configure_pair(lambda: ProcessGroupGloo(timeout=TIMEOUT), "plain")
    assert _options(pgs[0].parent).group_name == ""


def test_group_name_rule() -> None:
    assert quorum_group_name(3, 5, 4) == "torchft_3_rank_1"
    assert quorum_group_name(3, 0, 4) == "torchft_3_rank_0"  # group rank 0 is named too
    assert quorum_group_name(None, 1, 2) is None
    assert quorum_group_name(3, 1, 0) is None
    ProcessGroupDummy().configure("x:1/p", "r", 0, 1, quorum_id=1, group_rank=0)
