"""Fault-tolerant HSDP (FSDP2) with torchheal: the script a user copies.

Each replica group is an ordinary FSDP2 job sharding the model over its own ranks
(``dp_shard``); the replica groups together form the ``dp_replicate`` dimension, whose gradient
all-reduce goes through the torchheal Manager. Start a lighthouse, then one torchrun job per
replica group:

    torchheal lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000

    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --master_port=29600 --nnodes=1 --nproc_per_node=2 -- examples/train_hsdp.py

    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 TORCHFT_LIGHTHOUSE=http://localhost:29510 \\
        torchrun --master_port=29601 --nnodes=1 --nproc_per_node=2 -- examples/train_hsdp.py

Kill either job (kill -9) and start it again: the other keeps training and the restarted one
heals from it live, shard by shard (group rank ``r`` receives group rank ``r``'s shards). Runs
on CPU with Gloo by default and on CUDA with NCCL when a GPU is present. Data is synthetic.
Environment: ``STEPS`` (default 1000), ``HSDP_DIM`` (model width, default 256),
``GLOBAL_BATCH`` (default 32 per rank of every group).

Data follows the data plan (docs/data.md): each step reads ``GLOBAL_BATCH`` samples of one
shuffled order, split over the replica groups in the step's quorum and, inside a group, over its
ranks; a failed step is read again by the next quorum and the global batch stays constant while
a group is down.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from torchheal import Manager
from torchheal.data import DataPlan, StepLoader
from torchheal.device_mesh import ft_init_device_mesh
from torchheal.process_group import ProcessGroupGloo, ProcessGroupNCCL

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
# The reference's structured records (one per quorum, commit and abort, empty message, the data
# in their fields) are for log pipelines (TORCHFT_USE_OTEL exports them); keep them off the
# console, where the Manager's own line already says what happened.
for _name in ("torchft_quorums", "torchft_commits", "torchft_errors"):
    logging.getLogger(_name).propagate = False


def _local(value: Any) -> Any:
    # DTensors travel as their local shard: a healing rank receives the same group rank's
    # shard from its peer, so no resharding is needed.
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of the model and optimizer state (views, cheap every step).

    Args:
        model: the ``fully_shard``-ed model.
        optimizer: its optimizer.
    """
    return {"model": _local(model.state_dict()), "optim": _local(optimizer.state_dict())}


def load_local_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Loads shards made by :func:`local_state` on the same group rank of a healthy replica.

    Optimizer state is rebuilt as DTensors laid out like their parameters, so a freshly
    started optimizer (no state yet) can load it.

    Args:
        model: the ``fully_shard``-ed model.
        optimizer: its optimizer.
        state: the received state.
    """
    with torch.no_grad():
        for name, value in model.state_dict().items():
            value.to_local().copy_(_local(state["model"][name]))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rebuilt: dict[int, dict[str, Any]] = {}
    for index, entries in state["optim"]["state"].items():
        param = params[int(index)]
        rebuilt[int(index)] = {}
        for key, value in entries.items():
            value = _local(value)
            if isinstance(value, torch.Tensor) and value.shape == param.to_local().shape:
                value = DTensor.from_local(
                    value.to(param.to_local().device),
                    param.device_mesh,
                    param.placements,
                    shape=param.shape,
                    stride=param.stride(),
                )
            rebuilt[int(index)][key] = value
    optimizer.load_state_dict({"state": rebuilt, "param_groups": state["optim"]["param_groups"]})


class SyntheticRegression(torch.utils.data.Dataset):
    """Sample ``i``: ``x`` drawn from a generator seeded with ``i``, ``y = sin(sum(x))``."""

    def __init__(self, dim: int, size: int = 1_000_000) -> None:
        self.dim, self.size = dim, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.dim, generator=torch.Generator().manual_seed(i))
        return x, x.sum(dim=0, keepdim=True).sin()


def main() -> None:
    replica_group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    num_replica_groups = int(os.environ.get("NUM_REPLICA_GROUPS", "2"))
    steps = int(os.environ.get("STEPS", "1000"))
    dim = int(os.environ.get("HSDP_DIM", "256"))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    group_rank, group_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # identical initial weights in every replica group
    model = nn.Sequential(
        nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.GELU(), nn.Linear(dim, 1)
    )
    if device is not None:
        model = model.to(device)
    optimizer: torch.optim.Optimizer | None = None

    def state_dict() -> dict[str, Any]:
        assert optimizer is not None
        return local_state(model, optimizer)

    def load_state_dict(state: dict[str, Any]) -> None:
        assert optimizer is not None
        load_local_state(model, optimizer, state)

    timeout = timedelta(seconds=30)
    # Between replica groups: NCCL on GPUs, Gloo on CPU; REPLICA_PG=gloo forces Gloo (several
    # replica groups sharing one GPU: NCCL refuses two ranks of one communicator on one device).
    use_nccl = use_cuda and os.environ.get("REPLICA_PG", "nccl") == "nccl"
    pg = ProcessGroupNCCL(timeout=timeout) if use_nccl else ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        replica_id=f"train_hsdp_{replica_group}",
        init_sync=False,  # identical initial weights (seeded); see docs/data.md
    )
    mesh = ft_init_device_mesh(
        device_type="cuda" if use_cuda else "cpu",
        mesh_shape=(num_replica_groups, group_size),
        mesh_dim_names=("dp_replicate", "dp_shard"),
        replicate_dim=0,
        manager=manager,
    )
    hsdp_mesh = mesh["dp_replicate", "dp_shard"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=hsdp_mesh)
    fully_shard(model, mesh=hsdp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    dataset = SyntheticRegression(dim)
    global_batch = int(os.environ.get("GLOBAL_BATCH", str(32 * group_size * num_replica_groups)))
    plan = DataPlan(dataset_size=len(dataset), batch_size=global_batch, seed=0)
    # Each rank reads its slice of its group's share of the step; FSDP2 averages the group's
    # ranks and the Manager the groups, which loss_scale assumes.
    loader = StepLoader(dataset, plan, manager, group_rank=group_rank, group_size=group_size)
    while manager.current_step() < steps:
        optimizer.zero_grad()
        manager.start_quorum()
        batch = loader.next_step()  # waits for the quorum: this rank's slice of the step
        for x, y in batch:  # one micro-batch: no cap on the plan
            if device is not None:
                x, y = x.to(device), y.to(device)
            loss = nn.functional.mse_loss(model(x), y, reduction="sum")
            # FSDP2: reduce-scatter in the group, all-reduce through the manager.
            (loss * batch.loss_scale).backward()
        loss = loss / max(1, len(batch.indices))  # per sample, for the log line
        if manager.should_commit():
            optimizer.step()
        if manager.current_step() % 100 == 0 and group_rank == 0:
            logging.info(
                "step %d loss %.4f participants %d",
                manager.current_step(),
                loss.item(),
                manager.num_participants(),
            )
    checks, mismatches = manager.divergence_checks()
    if checks:  # the divergence guard ran (on by default: every 100 steps)
        logging.info("divergence checks %d mismatches %d", checks, mismatches)
    manager.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
