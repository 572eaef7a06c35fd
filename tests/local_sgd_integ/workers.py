"""One replica group's semi-synchronous training loop, shared by thread and process tests.

:func:`train_replica` runs LocalSGD or (Streaming) DiLoCo with a real :class:`Manager`, a real
``ProcessGroupGloo`` (wrapped in ``FakeProcessGroupWrapper`` so an allreduce failure can be
injected) and the default HTTP checkpoint transport, and returns the replica's final state: the
model, and for DiLoCo every fragment's global weights and outer-optimizer state.

How a replica "dies" is left to the caller (``on_fail``): a thread raises and is restarted in
the same process (``jobs.py``); a process SIGKILLs itself and the harness restarts it
(:func:`process_worker`, run by ``tests/integration/jobs.py``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

IN, HIDDEN, OUT = 6, 8, 3


@dataclass(frozen=True)
class TrainConfig:
    """What every replica group of one run does.

    Args:
        algorithm: ``"diloco"`` or ``"localsgd"``.
        n_fragments: DiLoCo model fragments (1 or 2; the model has two linear layers).
        sync_every: inner steps per full sync (every fragment once).
        fragment_sync_delay: DiLoCo inner steps between a fragment's allreduce and its merge.
        alpha: DiLoCo ``fragment_update_alpha``.
        outer_steps: the manager step every replica trains to (one per fragment sync).
        expected_groups: keep training past ``outer_steps`` until a quorum had this many
            replica groups, so a late joiner is never left alone waiting for a quorum.
        min_replica_size: Manager ``min_replica_size``.
        use_async_quorum: Manager ``use_async_quorum`` (DiLoCo requires False).
        timeout_s: Manager and Gloo timeout.
        quorum_timeout_s: Manager quorum timeout (covers a peer's restart).
        transport: checkpoint transport, ``"http"`` (the default one) or ``"pg"``.
        init_sync: Manager ``init_sync``.
        same_seed: every group and incarnation starts from the same model.
        max_inner_steps: stop after this many inner steps even if not done (bounds a run
            that is expected to fail).
        should_quantize: DiLoCo allreduces its pseudo-gradients through 8-bit quantization.
    """

    algorithm: str = "diloco"
    n_fragments: int = 1
    sync_every: int = 4
    fragment_sync_delay: int = 0
    alpha: float = 0.0
    outer_steps: int = 4
    expected_groups: int = 2
    min_replica_size: int = 2
    use_async_quorum: bool = False
    timeout_s: float = 10.0
    quorum_timeout_s: float = 60.0
    transport: str = "http"
    init_sync: bool = True
    same_seed: bool = False
    max_inner_steps: int | None = None
    should_quantize: bool = False


@dataclass(frozen=True)
class Faults:
    """Failures injected into one incarnation of a replica group.

    Args:
        fail_before_inner_step: call ``on_fail`` when about to run this inner step (0-based,
            counted within the incarnation).
        fail_allreduce_at_step: make the sync allreduce of this manager step fail.
    """

    fail_before_inner_step: int | None = None
    fail_allreduce_at_step: int | None = None


_GLOBAL_RNG = threading.Lock()


def make_model(seed: int) -> nn.Sequential:
    """The model: two linear layers, which are the two fragments when ``n_fragments == 2``."""
    # Replica groups may be threads of one process, and torch's seeded RNG is process-wide:
    # seeding and initialising must not interleave with another group's.
    with _GLOBAL_RNG:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica group ``group``'s batch for inner step ``step``: groups see different data."""
    gen = torch.Generator().manual_seed(10_007 * group + step)
    return torch.randn(8, IN, generator=gen), torch.randn(8, OUT, generator=gen)


def train_replica(
    cfg: TrainConfig,
    faults: Faults,
    group: int,
    incarnation: int,
    lighthouse_addr: str,
    store_port: int,
    on_fail: Callable[[], None],
    on_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Train one replica group (world size 1) to ``cfg.outer_steps`` and return its state.

    Args:
        cfg: the run's configuration.
        faults: failures to inject into this incarnation.
        group: replica group index (replica id ``g{group}``); selects the data.
        incarnation: restart count; seeds the model so a restarted group starts different
            and only healing can make it equal to its peers.
        lighthouse_addr: the lighthouse.
        store_port: this group's TCPStore on 127.0.0.1.
        on_fail: called at ``faults.fail_before_inner_step``; must not return.
        on_step: called with the manager step after every inner step.
    """
    from torchheal import Manager, ProcessGroupGloo
    from torchheal.checkpointing import HTTPTransport
    from torchheal.checkpointing.pg_transport import PGTransport
    from torchheal.local_sgd import DiLoCo, LocalSGD
    from torchheal.process_group import FakeProcessGroupWrapper

    timeout = timedelta(seconds=cfg.timeout_s)
    model = make_model(0 if cfg.same_seed else 1 + 100 * group + incarnation)
    inner = torch.optim.AdamW(model.parameters(), lr=0.05)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner_optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner_optim"])

    pg = FakeProcessGroupWrapper(ProcessGroupGloo(timeout=timeout))
    transport: Any = (
        PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
        if cfg.transport == "pg"
        else HTTPTransport(timeout=timeout, num_chunks=0)
    )
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=cfg.min_replica_size,
        use_async_quorum=cfg.use_async_quorum,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store_port,
        lighthouse_addr=lighthouse_addr,
        replica_id=f"g{group}",
        checkpoint_transport=transport,
        init_sync=cfg.init_sync,
    )
    try:
        if cfg.algorithm == "diloco":
            fragments: list[nn.Module] = [model] if cfg.n_fragments == 1 else [model[0], model[2]]
            outer = [
                torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
                for f in fragments
            ]
            algo: Any = DiLoCo(
                manager,
                fragments,
                inner,
                outer,
                sync_every=cfg.sync_every,
                fragment_sync_delay=cfg.fragment_sync_delay,
                fragment_update_alpha=cfg.alpha,
                should_quantize=cfg.should_quantize,
            )
        elif cfg.algorithm == "localsgd":
            algo = LocalSGD(manager, model, inner, sync_every=cfg.sync_every)
        else:
            raise ValueError(f"unknown algorithm {cfg.algorithm!r}")

        inner_steps = 0
        failed_steps: list[int] = []
        participants: list[int] = []
        armed = False
        with algo:
            while (
                manager.current_step() < cfg.outer_steps
                or max(participants, default=0) < cfg.expected_groups
            ):
                if cfg.max_inner_steps is not None and inner_steps >= cfg.max_inner_steps:
                    break
                if faults.fail_before_inner_step == inner_steps:
                    on_fail()
                step = manager.current_step()
                if faults.fail_allreduce_at_step == step and not armed:
                    # No collective runs until this window's sync and the quorum id is stable,
                    # so the one-shot error hits the window's first allreduce.
                    pg.report_future_error(RuntimeError("injected allreduce failure"))
                    armed = True
                inner.zero_grad()
                x, y = batch(group, 1000 * incarnation + inner_steps)
                nn.functional.mse_loss(model(x), y).backward()
                quorum_before = manager._quorum_future
                step_before = manager.current_step()
                inner.step()  # the algorithm's hooks start quorums and sync in here
                inner_steps += 1
                if manager._quorum_future is not quorum_before:
                    participants.append(manager.num_participants())
                # Both algorithms reset their window counter right after a sync's vote.
                if algo._local_step == 0 and manager.current_step() == step_before:
                    failed_steps.append(step_before)
                if on_step is not None:
                    on_step(manager.current_step())

        result: dict[str, Any] = {
            "step": manager.current_step(),
            "inner_steps": inner_steps,
            "failed_steps": failed_steps,
            "participants": participants,
            "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        }
        if cfg.algorithm == "diloco":
            result["fragments"] = [
                {
                    "original_parameters": {k: v.clone() for k, v in f.original_parameters.items()},
                    "outer_optimizer": f._outer_optimizer.state_dict(),
                }
                for f in algo._fragments
            ]
        return result
    finally:
        manager.shutdown(wait=False)
        pg.shutdown()


def process_worker(
    cfg: TrainConfig,
    spec: Any,
    plan: Any,
    group_rank: int,
    store_port: int,
    incarnation: int,
    out_path: str,
) -> None:
    """Entry point for ``tests.integration.jobs.run_job`` (bind ``cfg`` with partial).

    ``plan.kill_at_step`` is the inner step before which the process SIGKILLs itself.
    """
    logging.basicConfig(
        level=logging.WARNING, format=f"g{plan.group}i{incarnation} %(name)s %(message)s"
    )
    assert group_rank == 0 and plan.world_size == 1, "one rank per replica group"

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    faults = Faults(
        fail_before_inner_step=plan.kill_at_step,
        fail_allreduce_at_step=plan.fail_allreduce_at_step,
    )
    result = train_replica(
        cfg, faults, plan.group, incarnation, spec.lighthouse_addr, store_port, die
    )
    torch.save(result, out_path)
