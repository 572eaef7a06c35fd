"""Bucketed allreduce: pack many small tensors into few flat buffers, one allreduce each.

Tensors are packed greedily in order into the open bucket of their (dtype, device), so mixed
dtypes are never mis-cast (the reference assumes one); a bucket holds at most ``cap_bytes``,
and a larger tensor gets a bucket of its own (the reference left it unreduced).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed import Work

from torchheal.local_sgd.localsgd import SyncManager

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "PendingBucket", "allreduce_bucketized", "plan_buckets"]

# The reference's class default: named in MB, but it is 1 GiB in bytes.
DEFAULT_BUCKET_CAP_BYTES = 1 * 1024 * 1024 * 1024


def plan_buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Buckets of indices into ``tensors`` (each once; ordered by their first tensor) holding
    at most ``cap_bytes`` each. Pure: looks only at sizes, dtypes and devices."""
    if cap_bytes < 1:
        raise ValueError(f"bucket cap must be >= 1 byte, got {cap_bytes}")
    buckets: list[list[int]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[int, int]] = {}  # -> (idx, bytes)
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        key = (t.dtype, t.device)
        if nbytes > cap_bytes:
            buckets.append([i])  # oversized: alone, and leave the open bucket open
            continue
        current = open_bucket.get(key)
        if current is not None and current[1] + nbytes <= cap_bytes:
            buckets[current[0]].append(i)
            open_bucket[key] = (current[0], current[1] + nbytes)
        else:
            buckets.append([i])
            open_bucket[key] = (len(buckets) - 1, nbytes)
    return buckets


@dataclass
class PendingBucket:
    """An in-flight bucket allreduce: the flat buffer, its members and the work."""

    flat: torch.Tensor
    members: list[torch.Tensor]
    work: Work
    in_place: bool  # flat is a view of the single member: nothing to copy back

    def finish(self) -> None:
        """Wait for the allreduce and copy the reduced values back into the members."""
        self.work.wait()
        if self.in_place:
            return
        offset = 0
        with torch.no_grad():
            for t in self.members:
                n = t.numel()
                t.copy_(self.flat[offset : offset + n].view_as(t))
                offset += n


def allreduce_bucketized(
    manager: SyncManager,
    tensors: Sequence[torch.Tensor],
    cap_bytes: int,
    should_quantize: bool = False,
) -> list[PendingBucket]:
    """Start one ``manager.allreduce`` per bucket of ``tensors``; does not wait (the tensors
    receive the averages in :meth:`PendingBucket.finish`)."""
    pending = []
    for bucket in plan_buckets(tensors, cap_bytes):
        members = [tensors[i] for i in bucket]
        in_place = len(members) == 1 and members[0].is_contiguous()
        if in_place:
            flat = members[0].view(-1)  # reduce the tensor itself, no copy needed
        else:
            flat = torch.cat([t.detach().reshape(-1) for t in members])
        work = manager.allreduce(flat, should_quantize=should_quantize)
        pending.append(PendingBucket(flat=flat, members=members, work=work, in_place=in_place))
    return pending
