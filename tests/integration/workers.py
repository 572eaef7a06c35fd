"""Per-rank entry points for the end-to-end tests (run in spawned processes by ``jobs.py``).

Each rank trains a small MLP with Adam through torchheal's DDP wrapper on data that depends on
(group, rank, step), so the cross-group average is real, and writes its final state to a file.
Failures are real: a planned kill is a SIGKILL of the rank's own process.
"""

from __future__ import annotations

import logging
import os
import signal
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from tests.integration.jobs import GroupPlan, JobSpec
from torchheal.checkpointing.transport import CheckpointTransport

IN, HIDDEN, OUT = 8, 16, 4


def make_model(seed: int) -> nn.Module:
    # A smooth activation, not ReLU: the fail-fast and partition tests compare the trained
    # weights with a replay of the committed history, and Gloo sums three contributions in an
    # order of its own, a last-bit difference. With ReLU such a difference flipped a unit whose
    # pre-activation was 8e-8 from zero and grew into a 1e-3 gap (seen once in ~15 partition
    # runs, traced step by step: every reduced gradient matched its inputs exactly).
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(group: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch that rank ``rank`` of group ``group`` trains on at ``step``."""
    gen = torch.Generator().manual_seed(100_003 * group + 1_009 * rank + step)
    return torch.randn(16, IN, generator=gen), torch.randn(16, OUT, generator=gen)


def train_ddp(
    spec: JobSpec,
    plan: GroupPlan,
    group_rank: int,
    store_port: int,
    incarnation: int,
    out_path: str,
) -> None:
    """One rank of one replica group: fault-tolerant DDP training to ``spec.steps``."""
    from torchheal import (
        DistributedDataParallel,
        Manager,
        Optimizer,
        ProcessGroupGloo,
        ProcessGroupNCCL,
    )
    from torchheal.checkpointing import HTTPTransport
    from torchheal.checkpointing.pg_transport import PGTransport
    from torchheal.manager import WorldSizeMode
    from torchheal.process_group import FakeProcessGroupWrapper

    logging.basicConfig(
        level=logging.INFO, format=f"g{plan.group}r{group_rank}i{incarnation} %(name)s %(message)s"
    )
    timeout = timedelta(seconds=spec.timeout_s)
    device = torch.device(spec.device)
    model = make_model(0 if spec.same_seed else 1 + plan.group * 10 + incarnation).to(device)
    inner = torch.optim.Adam(model.parameters(), lr=0.01)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    backend = ProcessGroupNCCL if spec.backend == "nccl" else ProcessGroupGloo
    pg = FakeProcessGroupWrapper(backend(timeout=timeout))
    if plan.corrupt_first_heal:
        transport = corrupting_http_transport(timeout)
    else:
        transport = (
            PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
            if spec.transport == "pg"
            else HTTPTransport(timeout=timeout, num_chunks=0)
        )
    transport = CountingTransport(transport)
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=spec.min_replica_size,
        use_async_quorum=spec.use_async_quorum,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=spec.quorum_timeout_s),
        connect_timeout=timedelta(seconds=10),
        rank=group_rank,
        world_size=plan.world_size,
        world_size_mode=WorldSizeMode[spec.world_size_mode],
        store_addr="127.0.0.1",
        store_port=store_port,
        lighthouse_addr=spec.lighthouse_addr,
        replica_id=f"g{plan.group}",
        checkpoint_transport=transport,
        init_sync=spec.init_sync,
        max_retries=spec.max_retries,
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    commits = 0
    failed_steps: list[int] = []
    while manager.current_step() < spec.steps:
        step = manager.current_step()
        if plan.kill_at_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()  # starts the quorum: a synchronous heal moves the step here
        step = manager.current_step()
        if plan.fail_allreduce_at_step == step:
            pg.report_future_error(RuntimeError("injected allreduce failure"))
        x, y = batch(plan.group, group_rank, step)
        loss = nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        if manager.current_step() > step:
            commits += 1
        else:
            failed_steps.append(step)
    torch.save(
        {
            "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "step": manager.current_step(),
            "batches_committed": manager.batches_committed(),
            "commits": commits,
            "failed_steps": failed_steps,
            "sent_steps": transport.sent_steps,
            "received_steps": transport.received_steps,
        },
        out_path,
    )
    manager.shutdown()


class CountingTransport(CheckpointTransport[Any]):
    """Wraps a checkpoint transport and records the steps it sent and received state for.

    Args:
        inner: the real transport.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent_steps: list[int] = []
        self.received_steps: list[int] = []

    def metadata(self) -> str:
        return self.inner.metadata()

    @property
    def copies_state(self) -> bool:  # what the inner transport says (HTTP: it copies)
        return self.inner.copies_state

    @property
    def copies_on_write(self) -> bool:  # HTTP: serves the live state, copies before changes
        return self.inner.copies_on_write

    @property
    def runs_beside_collectives(self) -> bool:  # so heals run beside the collectives
        return self.inner.runs_beside_collectives

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: Any
    ) -> None:
        self.sent_steps.append(step)
        self.inner.send_checkpoint(dst_ranks, step, state_dict, timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: Any) -> Any:
        self.received_steps.append(step)
        return self.inner.recv_checkpoint(src_rank, metadata, step, timeout)

    def disallow_checkpoint(self) -> None:
        self.inner.disallow_checkpoint()

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait=wait)


def failure_free(
    steps: int, rank: int = 0, groups: int = 2, *, async_init_sync: bool = True
) -> dict[str, torch.Tensor]:
    """The weights rank ``rank`` of every group ends with when nothing ever fails.

    With ``init_sync`` every group starts from the model of group rank ``rank``'s primary
    (group ``rank % groups``). A committed step averages the gradients of every group's batch
    of that step, except step 0 under an asynchronous quorum: the other groups are still
    receiving the primary's state during that forward pass, so they send zeros (the divisor
    stays ``groups``). Failures only delay steps (a failed step is retried with the same data,
    and no step commits without every group when ``min_replica_size`` is the group count), so
    a job with failures must end exactly here.

    Args:
        steps: committed steps.
        rank: the group rank.
        groups: replica groups.
        async_init_sync: asynchronous quorum with ``init_sync`` (the step-0 rule above).
    """
    primary = rank % groups
    model = make_model(1 + primary * 10)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    params = list(model.parameters())
    for step in range(steps):
        total: list[torch.Tensor] | None = None
        for group in range(groups):
            model.zero_grad()
            x, y = batch(group, rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            grads = [p.grad.detach().clone() for p in params]
            if step == 0 and async_init_sync and group != primary:
                grads = [torch.zeros_like(g) for g in grads]
            total = grads if total is None else [t + g for t, g in zip(total, grads, strict=True)]
        assert total is not None
        for p, g in zip(params, total, strict=True):
            p.grad = g.div_(groups)
        optimizer.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def corrupting_http_transport(timeout: timedelta) -> Any:
    """An HTTPTransport whose first received checkpoint travels through a corrupting proxy."""
    from urllib.parse import urlsplit, urlunsplit

    from tests.integration.corrupting_proxy import CorruptingProxy
    from torchheal.checkpointing import HTTPTransport

    class CorruptingHTTPTransport(HTTPTransport):
        proxy: CorruptingProxy | None = None

        def recv_checkpoint(self, src_rank, metadata, step, timeout=None):  # type: ignore[override]
            if self.proxy is None:
                url = urlsplit(metadata)
                self.proxy = CorruptingProxy((url.hostname, url.port))
                metadata = urlunsplit(url._replace(netloc=f"127.0.0.1:{self.proxy.port}"))
            return super().recv_checkpoint(src_rank, metadata, step, timeout)

    return CorruptingHTTPTransport(timeout=timeout, num_chunks=0)


def train_plain_ddp(rank: int, world_size: int, store_port: int, steps: int, out_path: str) -> None:
    """The same training with stock torch DDP: rank r sees group r's batches."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        model = make_model(0)
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        for step in range(steps):
            optimizer.zero_grad()
            x, y = batch(rank, 0, step)
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
        torch.save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, out_path)
        # Both ranks done with every collective before either tears its group down: a rank
        # that exits while its peer's last operation is in flight can abort the peer in Gloo.
        dist.barrier()
    finally:
        dist.destroy_process_group()
