"""Fault-tolerant data parallelism across replica groups.

Both classes average gradients over the participating replicas through ``Manager.allreduce``; a
failed collective never crashes the backward pass (the step is not committed).
"""

# No "from __future__ import annotations": DDP inspects the comm hook's real annotations.

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.nn import parallel

from torchheal.process_group import ProcessGroupDummy
from torchheal.work import _ManagedWork


def _completed(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


class DistributedDataParallel(parallel.DistributedDataParallel):
    """PyTorch DDP whose gradient buckets are reduced across replica groups by the Manager.

    DDP runs over a :class:`ProcessGroupDummy` (``init_sync`` off: the Manager keeps replicas in
    sync); ``find_unused_parameters=True`` keeps a recovering replica's buckets equal to its
    peers'. Unlike the reference, ``gradient_as_bucket_view`` defaults to True (saves a copy).

    Args:
        manager: the Manager of this rank.
        module: the model.
        **kwargs: passed to ``torch.nn.parallel.DistributedDataParallel`` (except
            ``process_group`` and ``find_unused_parameters``, which are fixed; ``init_sync``
            defaults to False, ``gradient_as_bucket_view`` to True).
    """

    def __init__(self, manager: Any, module: nn.Module, **kwargs: Any) -> None:
        for fixed in ("process_group", "find_unused_parameters"):
            if fixed in kwargs:
                raise ValueError(f"torchheal DistributedDataParallel sets {fixed} itself")
        kwargs.setdefault("init_sync", False)
        kwargs.setdefault("gradient_as_bucket_view", True)
        if (
            getattr(manager, "salvage_step", False) is True
            and not kwargs["gradient_as_bucket_view"]
        ):
            raise ValueError(
                "gradient_as_bucket_view=False copies each reduced bucket into the gradients "
                "before should_commit, which a salvaged step would redo afterwards: keep the "
                "default (True) or build the Manager with salvage_step=False"
            )
        super().__init__(
            module,
            process_group=ProcessGroupDummy(0, 1),
            find_unused_parameters=True,
            **kwargs,
        )
        self.register_comm_hook(manager, self._comm_hook)

    @staticmethod
    def _comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        work = state.allreduce(buffer)
        if isinstance(work, _ManagedWork):
            # Not waited here (the reference blocks): DDP waits at the end of backward, so the
            # reduction overlaps it. A failure resolves to the (garbage) bucket, reported.
            return work.as_future()
        # The manager already failed this step: no communication, the step won't commit.
        return _completed(buffer)


class PureDistributedDataParallel(nn.Module):
    """Per-parameter fault-tolerant data parallelism (no bucketing; simple, slower).

    Each gradient is allreduced once accumulated, and the end of backward waits for all of them
    (the reference never waits, so its gradients are summed, not averaged).

    Args:
        manager: the Manager of this rank.
        module: the model.
    """

    def __init__(self, manager: Any, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._manager = manager
        self._works: list[dist.Work] = []
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        if not self._works:
            # First gradient of this backward pass: wait for all of them when it ends.
            Variable._execution_engine.queue_callback(self._wait_all)
        self._works.append(self._manager.allreduce(param.grad))

    def _wait_all(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()  # errors are reported to the manager, never raised

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module."""
        return self.module(*args, **kwargs)
