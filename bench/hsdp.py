"""HSDP step time with and without fault tolerance, on CPU/Gloo, in one run.

Plain: one torch.distributed world of ``groups x ranks`` processes, FSDP2 over a
``(dp_replicate, dp_shard)`` mesh from ``init_device_mesh``. Fault tolerant: ``groups``
replica groups of ``ranks`` processes, each its own world, FSDP2 over ``ft_init_device_mesh``
with the replicate all-reduce going through the torchheal Manager (async quorum, the default),
plus a lighthouse. Same model, data and step count; every rank times each step (zero_grad to
optimizer step, including the quorum and commit vote) and the table reports the slowest rank's
median per run; runs alternate for ``--rounds`` rounds and each keeps its best round.

    .venv/bin/python bench/hsdp.py --steps 60 --warmup 10
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


@dataclass(frozen=True)
class Config:
    """One benchmark run.

    Args:
        groups: replica groups (the dp_replicate size).
        ranks: ranks per group (the dp_shard size).
        steps: timed steps (after warm-up).
        warmup: untimed steps first.
        dim: model width.
        batch: per-rank batch size.
    """

    groups: int = 2
    ranks: int = 2
    steps: int = 60
    warmup: int = 10
    dim: int = 512
    batch: int = 64


def _model(dim: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.GELU(), nn.Linear(dim, 1)
    )


def _shard(model: nn.Module, mesh: Any) -> None:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _data(cfg: Config, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.batch, cfg.dim, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def _plain_rank(cfg: Config, global_rank: int, port: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group(
        "gloo", store=store, rank=global_rank, world_size=cfg.groups * cfg.ranks
    )
    mesh = init_device_mesh(
        "cpu", (cfg.groups, cfg.ranks), mesh_dim_names=("dp_replicate", "dp_shard")
    )
    model = _model(cfg.dim)
    _shard(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _data(cfg, global_rank)
    times = []
    for step in range(cfg.warmup + cfg.steps):
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step >= cfg.warmup:
            times.append(time.perf_counter() - start)
    out.put(("plain", global_rank, times))
    dist.destroy_process_group()


def _ft_rank(cfg: Config, group: int, rank: int, port: int, lighthouse: str, out: mp.Queue) -> None:
    from torchheal.device_mesh import ft_init_device_mesh
    from torchheal.manager import Manager
    from torchheal.process_group.gloo import ProcessGroupGloo

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("dist", store), rank=rank, world_size=cfg.ranks
    )
    model = _model(cfg.dim)

    # What a real job registers: this rank's shards (views), captured at every start_quorum.
    def state_dict() -> dict[str, Any]:
        return {k: v.to_local() for k, v in model.state_dict().items()}

    def load_state_dict(state: dict[str, Any]) -> None:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.to_local().copy_(state[k])

    timeout = timedelta(seconds=30)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        rank=rank,
        world_size=cfg.ranks,
        store_addr="127.0.0.1",
        store_port=port,
        lighthouse_addr=lighthouse,
        replica_id=f"bench{group}",
        init_sync=False,  # identical seeds; the benchmark measures steady-state steps
    )
    mesh = ft_init_device_mesh(
        device_type="cpu",
        mesh_shape=(cfg.groups, cfg.ranks),
        mesh_dim_names=("dp_replicate", "dp_shard"),
        replicate_dim=0,
        manager=manager,
    )
    _shard(model, mesh["dp_replicate", "dp_shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _data(cfg, group * cfg.ranks + rank)
    times = []
    for step in range(cfg.warmup + cfg.steps):
        start = time.perf_counter()
        opt.zero_grad()
        manager.start_quorum()
        nn.functional.mse_loss(model(x), y).backward()
        if manager.should_commit():
            opt.step()
        if step >= cfg.warmup:
            times.append(time.perf_counter() - start)
    out.put(("ft", group * cfg.ranks + rank, times))
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def _collect(
    procs: list[mp.process.BaseProcess], out: mp.Queue, timeout: float
) -> dict[int, list[float]]:
    results: dict[int, list[float]] = {}
    deadline = time.monotonic() + timeout
    try:
        for _ in procs:
            _, rank, times = out.get(timeout=max(1.0, deadline - time.monotonic()))
            results[rank] = times
    finally:
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(10)
    return results


def run_plain(cfg: Config) -> dict[int, list[float]]:
    """Plain HSDP; returns each global rank's timed step durations (seconds)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        ctx.Process(target=_plain_rank, args=(cfg, r, store.port, out), daemon=True)
        for r in range(cfg.groups * cfg.ranks)
    ]
    for p in procs:
        p.start()
    return _collect(procs, out, timeout=600)


def run_ft(cfg: Config) -> dict[int, list[float]]:
    """Fault-tolerant HSDP; returns each rank's timed step durations (seconds)."""
    from torchheal.coordination import LighthouseServer

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=cfg.groups, join_timeout_ms=100)
    stores = [
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for _ in range(cfg.groups)
    ]
    procs = [
        ctx.Process(
            target=_ft_rank,
            args=(cfg, g, r, stores[g].port, lighthouse.address(), out),
            daemon=True,
        )
        for g in range(cfg.groups)
        for r in range(cfg.ranks)
    ]
    try:
        for p in procs:
            p.start()
        return _collect(procs, out, timeout=600)
    finally:
        lighthouse.shutdown()


def _summary(results: dict[int, list[float]]) -> tuple[float, float, float]:
    # A synchronous step is as slow as its slowest rank: take the worst rank's statistics.
    medians = [statistics.median(t) for t in results.values()]
    means = [statistics.fmean(t) for t in results.values()]
    p90s = [sorted(t)[int(0.9 * (len(t) - 1))] for t in results.values()]
    return max(medians) * 1e3, max(means) * 1e3, max(p90s) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--warmup", type=int, default=Config.warmup)
    parser.add_argument("--dim", type=int, default=Config.dim)
    parser.add_argument("--batch", type=int, default=Config.batch)
    parser.add_argument("--groups", type=int, default=Config.groups)
    parser.add_argument("--ranks", type=int, default=Config.ranks)
    parser.add_argument("--rounds", type=int, default=2, help="alternating plain/ft rounds")
    args = parser.parse_args()
    cfg = Config(args.groups, args.ranks, args.steps, args.warmup, args.dim, args.batch)
    params = sum(p.numel() for p in _model(cfg.dim).parameters())
    print(
        f"HSDP on CPU/Gloo: {cfg.groups} groups x {cfg.ranks} ranks, {params / 1e6:.2f}M params, "
        f"batch {cfg.batch}/rank, {cfg.steps} timed steps after {cfg.warmup} warm-up"
    )
    # Alternate the runs so a change in machine load hits both; keep each one's best round.
    plain_rounds, ft_rounds = [], []
    for _ in range(args.rounds):
        plain_rounds.append(_summary(run_plain(cfg)))
        ft_rounds.append(_summary(run_ft(cfg)))
    plain, ft = min(plain_rounds), min(ft_rounds)
    print(
        f"rounds: plain medians {[round(r[0], 1) for r in plain_rounds]} ms, "
        f"fault-tolerant medians {[round(r[0], 1) for r in ft_rounds]} ms"
    )
    print(f"{'run':<24}{'median ms':>12}{'mean ms':>12}{'p90 ms':>12}")
    print(f"{'plain HSDP':<24}{plain[0]:>12.2f}{plain[1]:>12.2f}{plain[2]:>12.2f}")
    print(f"{'fault-tolerant HSDP':<24}{ft[0]:>12.2f}{ft[1]:>12.2f}{ft[2]:>12.2f}")
    print(f"overhead (median): {100 * (ft[0] / plain[0] - 1):+.1f}%   (goal: within +10%)")


if __name__ == "__main__":
    main()
