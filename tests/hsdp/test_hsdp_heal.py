"""Fault-tolerant HSDP end to end on CPU/Gloo: 2 replica groups x 2 ranks, FSDP2 over
``["dp_replicate", "dp_shard"]``, gradient reduction across replicas through the Manager.

Replica group 1 is SIGKILLed in the middle of a step and started again (a fresh TCPStore, as a
restarted torchrun job gets). It must heal live from group 0, after which both groups hold
identical shards, and the run must end exactly where a plain HSDP run over the same data ends.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.hsdp._job import RankSpec, run_ft, run_plain

pytestmark = pytest.mark.slow

GROUPS = 2
RANKS = 2
STEPS = 5
KILL_AT = 2
DEADLINE_S = 150


def _ft_entry(spec: RankSpec, incarnation: int) -> None:
    run_ft(spec, incarnation)


def _plain_entry(spec: RankSpec) -> None:
    run_plain(spec)


def _wait(procs: list[mp.process.BaseProcess], deadline: float) -> None:
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def _end(procs: list[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Runs the plain job and the fault-tolerant job with a failure; returns the output dir."""
    from torchheal.coordination import LighthouseServer

    out = tmp_path_factory.mktemp("hsdp")
    ctx = mp.get_context("spawn")
    deadline = time.monotonic() + DEADLINE_S
    started: list[mp.process.BaseProcess] = []
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    try:
        # Fault-tolerant job: one TCPStore per replica group incarnation.
        stores = {
            g: dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            for g in range(GROUPS)
        }
        groups: dict[int, list[mp.process.BaseProcess]] = {}
        for g in range(GROUPS):
            groups[g] = []
            for r in range(RANKS):
                spec = RankSpec(
                    group=g,
                    rank=r,
                    group_size=RANKS,
                    num_groups=GROUPS,
                    steps=STEPS,
                    out_dir=str(out),
                    store_port=stores[g].port,
                    lighthouse_addr=lighthouse.address(),
                    kill_at_step=KILL_AT if g == 1 else None,
                )
                p = ctx.Process(target=_ft_entry, args=(spec, 0), daemon=True)
                p.start()
                groups[g].append(p)
                started.append(p)
        # Plays torchrun's agent for group 1: when it dies, start it again on a fresh store.
        _wait(groups[1], deadline)
        assert [p.exitcode for p in groups[1]] == [-signal.SIGKILL] * RANKS, (
            "group 1 was not killed"
        )
        stores[1] = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        restarted = []
        for r in range(RANKS):
            spec = RankSpec(
                group=1,
                rank=r,
                group_size=RANKS,
                num_groups=GROUPS,
                steps=STEPS,
                out_dir=str(out),
                store_port=stores[1].port,
                lighthouse_addr=lighthouse.address(),
            )
            p = ctx.Process(target=_ft_entry, args=(spec, 1), daemon=True)
            p.start()
            restarted.append(p)
            started.append(p)
        _wait(groups[0] + restarted, deadline)
        assert [p.exitcode for p in groups[0] + restarted] == [0] * (GROUPS * RANKS)

        # Plain HSDP over the same data: one world of GROUPS * RANKS ranks.
        world_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        plain = []
        for g in range(GROUPS):
            for r in range(RANKS):
                spec = RankSpec(g, r, RANKS, GROUPS, STEPS, str(out), world_store.port)
                p = ctx.Process(target=_plain_entry, args=(spec,), daemon=True)
                p.start()
                plain.append(p)
                started.append(p)
        _wait(plain, deadline)
        assert [p.exitcode for p in plain] == [0] * (GROUPS * RANKS)
    finally:
        _end(started)
        lighthouse.shutdown()
    return out


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    for index, entries in state["optim"]["state"].items():
        for key, value in entries.items():
            flat[f"optim.{index}.{key}"] = value
    return flat


@pytest.mark.parametrize("rank", range(RANKS))
def test_restarted_group_healed_and_finished(runs: Path, rank: int) -> None:
    healed = _load(runs / f"ft_g1_r{rank}.pt")
    survivor = _load(runs / f"ft_g0_r{rank}.pt")
    assert healed["step"] == survivor["step"] == STEPS
    # The restarted group healed once, live, to the step the survivor was retrying ...
    assert healed["healed"] == [KILL_AT]
    # ... and the survivor never healed after the start (step 0 sync is allowed: init_sync).
    assert all(step == 0 for step in survivor["healed"])
    # The survivor's reduction at the killed step failed, so it retried that step.
    assert set(survivor["failed_steps"]) == {KILL_AT}


@pytest.mark.parametrize("rank", range(RANKS))
def test_shards_identical_across_replicas(runs: Path, rank: int) -> None:
    a = _tensors(_load(runs / f"ft_g0_r{rank}.pt"))
    b = _tensors(_load(runs / f"ft_g1_r{rank}.pt"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("group", range(GROUPS))
@pytest.mark.parametrize("rank", range(RANKS))
def test_same_result_as_plain_hsdp(runs: Path, group: int, rank: int) -> None:
    ft = _tensors(_load(runs / f"ft_g{group}_r{rank}.pt"))
    plain = _tensors(_load(runs / f"plain_g{group}_r{rank}.pt"))
    assert ft.keys() == plain.keys()
    for key in ft:
        torch.testing.assert_close(ft[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)
