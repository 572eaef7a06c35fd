"""One rank of an HSDP training job, fault tolerant (torchheal) or plain (torch only).

Both variants train the same FSDP2 model on the same per-(replica group, group rank, step)
batches, so a fault-tolerant run that loses and heals a replica group must end exactly where a
plain HSDP run over the same data ends. Each rank writes its final local shards (parameters and
optimizer state) to ``{out_dir}/{tag}_g{group}_r{rank}.pt``.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

DIM = 32
BATCH = 8


@dataclass(frozen=True)
class RankSpec:
    """Where one rank sits and what happens to it.

    Args:
        group: replica group index.
        rank: rank within the group.
        group_size: ranks per replica group (the ``dp_shard`` size).
        num_groups: replica groups (the ``dp_replicate`` size).
        steps: committed steps to train.
        out_dir: where the final shards go.
        store_port: this group's TCPStore (fault tolerant) or the world's (plain).
        lighthouse_addr: the lighthouse (fault tolerant only).
        kill_at_step: SIGKILL this process after the forward pass of this step.
        timeout_s: collective/commit timeout of the manager.
        device: ``"cpu"`` (Gloo) or ``"cuda"`` (NCCL inside the group, one GPU per rank
            modulo the GPUs present; the cross-replica group stays Gloo so two replica
            groups can share one GPU).
    """

    group: int
    rank: int
    group_size: int
    num_groups: int
    steps: int
    out_dir: str
    store_port: int
    lighthouse_addr: str = ""
    kill_at_step: int | None = None
    timeout_s: float = 10.0
    device: str = "cpu"


def make_model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights everywhere
    return nn.Sequential(
        nn.Linear(DIM, 4 * DIM),
        nn.ReLU(),
        nn.Linear(4 * DIM, 4 * DIM),
        nn.ReLU(),
        nn.Linear(4 * DIM, 1),
    )


def shard(model: nn.Module, mesh: Any) -> None:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def batch(group: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * step + 100 * group + rank)
    x = torch.randn(BATCH, DIM, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _local(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of the model and optimizer (views: cheap to capture every step)."""
    return {"model": _local(model.state_dict()), "optim": _local(optimizer.state_dict())}


def load_local_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Loads shards captured by :func:`local_state` on the same group rank of a peer."""
    with torch.no_grad():
        for name, value in model.state_dict().items():
            received = _local(state["model"][name])
            value.to_local().copy_(received)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optim_state = state["optim"]
    rebuilt: dict[int, dict[str, Any]] = {}
    for index, entries in optim_state["state"].items():
        param = params[int(index)]
        local_shape = param.to_local().shape
        rebuilt[int(index)] = {
            key: DTensor.from_local(
                _local(t).to(param.to_local().device),
                param.device_mesh,
                param.placements,
                shape=param.shape,
                stride=param.stride(),
            )
            if isinstance(t, torch.Tensor) and _local(t).shape == local_shape
            else _local(t)
            for key, t in entries.items()
        }
    optimizer.load_state_dict({"state": rebuilt, "param_groups": optim_state["param_groups"]})


def _train_step(
    model: nn.Module, group: int, rank: int, step: int, kill_at: int | None, device: str = "cpu"
) -> None:
    x, y = (t.to(device) for t in batch(group, rank, step))
    loss = nn.functional.mse_loss(model(x), y)
    if kill_at == step:
        os.kill(os.getpid(), signal.SIGKILL)  # dies mid-step, before the gradient reduction
    loss.backward()


def _save(
    spec: RankSpec, tag: str, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict
) -> None:
    state = tree_map(
        lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t,
        local_state(model, optimizer),
    )
    state.update(extra)
    path = os.path.join(spec.out_dir, f"{tag}_g{spec.group}_r{spec.rank}.pt")
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def run_plain(spec: RankSpec) -> None:
    """Plain HSDP over one world of ``num_groups * group_size`` ranks (torch only)."""
    world = spec.num_groups * spec.group_size
    global_rank = spec.group * spec.group_size + spec.rank
    store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=global_rank, world_size=world)
    try:
        mesh = init_device_mesh(
            "cpu", (spec.num_groups, spec.group_size), mesh_dim_names=("dp_replicate", "dp_shard")
        )
        model = make_model()
        shard(model, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(spec.steps):
            optimizer.zero_grad()
            _train_step(model, spec.group, spec.rank, step, None)
            optimizer.step()
        _save(spec, "plain", model, optimizer, {"step": spec.steps})
    finally:
        dist.destroy_process_group()


def run_ft(spec: RankSpec, incarnation: int) -> None:
    """Fault-tolerant HSDP: this group's own world plus a managed replicate dimension."""
    from torchheal.device_mesh import ft_init_device_mesh
    from torchheal.manager import Manager
    from torchheal.process_group.gloo import ProcessGroupGloo

    device = spec.device
    if device == "cuda":
        torch.cuda.set_device(spec.rank % torch.cuda.device_count())
    store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False, wait_for_workers=False)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        store=dist.PrefixStore("dist", store),
        rank=spec.rank,
        world_size=spec.group_size,
    )
    model = make_model().to(device)
    optimizer: torch.optim.Optimizer | None = None
    healed: list[int] = []  # the step each heal brought this rank to

    def state_dict() -> dict[str, Any]:
        assert optimizer is not None
        return local_state(model, optimizer)

    def load_state_dict(state: dict[str, Any]) -> None:
        assert optimizer is not None
        load_local_state(model, optimizer, state)
        healed.append(manager.current_step())

    timeout = timedelta(seconds=spec.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=False,  # heal before the forward pass: every replica contributes
        timeout=timeout,
        quorum_timeout=timedelta(seconds=90),
        connect_timeout=timedelta(seconds=10),
        rank=spec.rank,
        world_size=spec.group_size,
        store_addr="127.0.0.1",
        store_port=spec.store_port,
        lighthouse_addr=spec.lighthouse_addr,
        replica_id=f"g{spec.group}",
    )
    try:
        mesh = ft_init_device_mesh(
            device_type=device,
            mesh_shape=(spec.num_groups, spec.group_size),
            mesh_dim_names=("dp_replicate", "dp_shard"),
            replicate_dim=0,
            manager=manager,
        )
        shard(model, mesh["dp_replicate", "dp_shard"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        kill_at = spec.kill_at_step if incarnation == 0 else None
        failed: list[int] = []
        started = time.monotonic()
        while manager.current_step() < spec.steps:
            optimizer.zero_grad()
            manager.start_quorum()
            step = manager.current_step()
            _train_step(model, spec.group, spec.rank, step, kill_at, device)
            if manager.should_commit():
                optimizer.step()
            else:
                failed.append(step)
        _save(
            spec,
            "ft",
            model,
            optimizer,
            {
                "step": manager.current_step(),
                "healed": healed,
                "failed_steps": failed,
                "seconds": time.monotonic() - started,
            },
        )
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()
