"""``ManagedProcessGroup(manager).register(name)`` reached the three ways torchtitan reaches it.

torchtitan (per-step FT) registers the group as ``"dp_replicate"`` before any collective, then
uses the object as ``group=`` in ``dist.all_reduce(grad, group=pg, op=ReduceOp.AVG)`` (from
FSDP2's all-reduce hook) and in ``funcol.all_reduce(x, "SUM" | "MAX", group=pg)`` (loss and
token-count sync), and reads ``pg.size()``. Two replica groups of one process each, as real
spawned processes with their own default (world-1) group, against a real lighthouse.
"""

from __future__ import annotations

import queue
from datetime import timedelta
from typing import Any

import pytest

from tests import warm
from torchheal.coordination.lighthouse.server import LighthouseServer

pytestmark = pytest.mark.timeout(120)
STEPS = 2


def _replica(index: int, lighthouse: str, results: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed import ReduceOp

    from torchheal import Manager, ProcessGroupGloo
    from torchheal.process_group import ManagedProcessGroup

    timeout = timedelta(seconds=20)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    weight = torch.zeros(2)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        load_state_dict=lambda sd: weight.copy_(sd["w"]),
        state_dict=lambda: {"w": weight},
        replica_id=f"torchtitan_ft_{index}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    pg = ManagedProcessGroup(manager)
    pg.register("dp_replicate")  # before any collective, return value ignored (torchtitan)
    out: dict[str, Any] = {"index": index, "steps": []}
    try:
        for _ in range(STEPS):
            manager.start_quorum()
            grad = torch.tensor([1.0, 2.0]) * (index + 1)
            dist.all_reduce(grad, group=pg, op=ReduceOp.AVG)
            loss = torch.tensor([10.0 * (index + 1)])
            summed = funcol.wait_tensor(funcol.all_reduce(loss, "SUM", group=pg))
            ntokens = torch.tensor([float(100 + index)])
            biggest = funcol.wait_tensor(funcol.all_reduce(ntokens, "MAX", group=pg))
            committed = manager.should_commit()
            out["steps"].append(
                {
                    "avg": grad.tolist(),
                    "sum": summed.item(),
                    "max": biggest.item(),
                    "size": pg.size(),
                    "committed": committed,
                }
            )
    except Exception as e:
        out["error"] = repr(e)
    finally:
        results.put(out)
        manager.shutdown(wait=False)
        dist.destroy_process_group()


def test_registered_managed_group_serves_avg_sum_and_max() -> None:
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    ctx = warm.mp_context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(i, lighthouse.address(), results)) for i in (0, 1)]
    try:
        for p in procs:
            p.start()
        outs = {}
        for _ in procs:
            try:
                out = results.get(timeout=90)
            except queue.Empty:
                pytest.fail("a replica group did not report within 90 s")
            outs[out["index"]] = out
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    # Step 0: group 1 heals from group 0 (init_sync) and contributes zeros while doing so;
    # both count as participants. Step 1: both contribute.
    expected = [
        {"avg": [0.5, 1.0], "sum": 10.0, "max": 100.0, "size": 2, "committed": True},
        {"avg": [1.5, 3.0], "sum": 30.0, "max": 101.0, "size": 2, "committed": True},
    ]
    for out in outs.values():
        assert "error" not in out, out["error"]
        assert out["steps"] == expected
