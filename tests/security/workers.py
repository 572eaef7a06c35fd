"""One rank of a replica group for the end-to-end security test (a spawned process).

It inherits the job's token and TLS settings from the test's environment, as a launched group
would, trains a three-number "model" with torchheal's Manager, and writes every committed step's
weights, whether it healed from its peer, and the most participants it saw, to ``out``.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import torch

STEPS = 20


def train(group: int, lighthouse: str, store_port: int, out: str) -> None:
    from torchheal import Manager, ProcessGroupGloo

    timeout = timedelta(seconds=20)
    weight = torch.zeros(3)
    loads: list[int] = []

    def load_state_dict(state: dict) -> None:
        loads.append(int(state["step"]))
        weight.copy_(state["weight"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=lambda: {"weight": weight, "step": manager.current_step()},
        min_replica_size=1,
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        replica_id=f"sec{group}",
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    history: dict[int, list[float]] = {}
    most = 0
    try:
        # Both go on until they trained together (group 1 healed from group 0) for 3 steps.
        while manager.current_step() < STEPS or len(history) < 3:
            manager.start_quorum()
            grad = torch.full((3,), float(manager.current_step() % 5 + 1))
            manager.allreduce(grad).wait()
            if manager.should_commit():
                weight.sub_(0.1 * grad)
                most = max(most, manager.num_participants())
                if manager.num_participants() == 2:
                    history[manager.current_step()] = weight.tolist()
            time.sleep(0.05)  # a step of "compute": group 1 starts while group 0 trains
    finally:
        manager.shutdown(wait=False)
    with open(out, "w") as f:
        json.dump({"history": history, "loads": loads, "most": most}, f)
