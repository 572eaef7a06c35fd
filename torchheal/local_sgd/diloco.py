"""DiLoCo and Streaming DiLoCo: inner steps locally, outer steps on averaged pseudo-gradients.

Each model fragment keeps its *global* weights (the last committed outer result). Every
``sync_every // n_fragments`` inner steps one fragment synchronises:

* ``prepare_sync`` (``fragment_sync_delay`` steps before): allreduce ``global - local``;
* ``perform_sync``: reset the fragment to its global weights and vote; on commit step the outer
  optimizer on the averaged deltas, save the new global weights and merge
  ``p = global + alpha * (local - global)``; on a failed commit the window's progress is dropped.

The fragment is ``manager.current_step() % n_fragments``: every replica agrees on the step, and
a failed commit does not advance it, so the same fragment is retried. Global weights and outer
optimizer state are registered with the manager, so a healed replica resumes from its peers'.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import Work

from torchheal._base import manager_env
from torchheal._base.salvage_guard import refuse_salvage
from torchheal.local_sgd.bucketing import (
    DEFAULT_BUCKET_CAP_BYTES,
    PendingBucket,
    allreduce_bucketized,
)
from torchheal.local_sgd.localsgd import (
    OptimizerStepHooks,
    SyncManager,
    extract_local_tensor,
    is_dtensor,
    local_view,
)

__all__ = ["DiLoCo"]


def _side_stream(device: torch.device) -> torch.Stream | None:
    """A stream to overlap allreduces with compute; None on CPU where there is nothing to gain."""
    if device.type == "cpu" or not torch.accelerator.is_available():
        return None
    return torch.Stream(device=device)


class _StreamingDiLoCoFragment:
    """Global weights, pseudo-gradients and outer optimizer of one model fragment."""

    def __init__(
        self,
        manager: SyncManager,
        model_fragment: nn.Module,
        fragment_id: int,
        outer_optimizer: torch.optim.Optimizer,
        backup_device: torch.device | None,
        pin_memory: bool,
        use_bucketization: bool,
        bucket_cap_bytes: int,
        should_quantize: bool,
        fragment_update_alpha: float,
    ) -> None:
        self._manager = manager
        self._model = model_fragment
        self._fragment_id = fragment_id
        self._outer_optimizer = outer_optimizer
        self._use_bucketization = use_bucketization
        # In bytes despite its name: the reference's attribute, which its tests set.
        self.bucket_cap_mb = bucket_cap_bytes
        self._should_quantize = should_quantize
        self._alpha = fragment_update_alpha

        device = backup_device if backup_device is not None else torch.device("cpu")
        # Pinned host memory makes device<->host copies of the backup asynchronous.
        pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
        self.original_parameters: dict[str, torch.Tensor] = {}
        for name, p in self._model.named_parameters():
            local = local_view(p)
            backup = torch.empty(local.shape, dtype=local.dtype, device=device, pin_memory=pin)
            self.original_parameters[name] = backup

        self._grads: dict[str, torch.Tensor] = {}
        self._local_parameters: dict[str, torch.Tensor] = {}
        self._pending_works: list[Work] = []
        self._pending_buckets: list[PendingBucket] = []
        self._prepared = False
        param_device = next((local_view(p).device for p in self._model.parameters()), None)
        self._stream = _side_stream(param_device) if param_device is not None else None

    @property
    def state_dict_key(self) -> str:
        """Key under which this fragment's state is registered with the manager."""
        return f"StreamingDiLoCoFragment_{self._fragment_id}"

    def register_state_dict_fn(self) -> None:
        """Register global weights and outer optimizer state with the manager (for healing)."""
        self._manager.register_state_dict_fn(
            self.state_dict_key, self.load_state_dict, self.state_dict
        )

    def state_dict(self) -> dict[str, Any]:
        """This fragment's global state: outer optimizer and global weights."""
        return {
            "outer_optimizer": self._outer_optimizer.state_dict(),
            "original_parameters": dict(self.original_parameters),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a peer's global state into this fragment (the backups are reused, not replaced)."""
        received = state_dict["original_parameters"]
        missing = set(self.original_parameters) - set(received)
        unexpected = set(received) - set(self.original_parameters)
        if missing or unexpected:
            raise KeyError(
                f"{self.state_dict_key}: received global weights do not match the fragment "
                f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})"
            )
        with torch.no_grad():
            for name, tensor in received.items():
                self.original_parameters[name].copy_(tensor)
        self._outer_optimizer.load_state_dict(state_dict["outer_optimizer"])

    def save_parameters(self) -> None:
        """Store the fragment's current weights as its global weights."""
        # Blocking on purpose: the backup may be read on the host (sent to a healing peer)
        # right after, and a device-to-host copy into pinned memory would still be in flight.
        with torch.no_grad():
            for name, p in self._model.named_parameters():
                self.original_parameters[name].copy_(local_view(p))

    def restore_parameters(self) -> None:
        """Reset the fragment's weights to its global weights."""
        with torch.no_grad():
            for name, p in self._model.named_parameters():
                local_view(p).copy_(self.original_parameters[name], non_blocking=True)

    def prepare_sync(self) -> None:
        """Compute pseudo-gradients and start their allreduce (not waited)."""
        self._save_grads()
        self._average_grads()
        self._prepared = True

    def _save_grads(self) -> None:
        """The pseudo-gradients: global weights minus local weights."""
        with torch.no_grad():
            for name, p in self._model.named_parameters():
                local = local_view(p)
                self._grads[name] = self.original_parameters[name].to(local.device) - local

    def _average_grads(self) -> None:
        """Starts the allreduce of the pseudo-gradients (:meth:`_wait_allreduce` waits)."""
        if self._stream is not None:
            # The deltas were computed on the current stream; the side stream must see them.
            self._stream.wait_stream(torch.accelerator.current_stream(self._stream.device))
            with self._stream:
                self._start_allreduce()
        else:
            self._start_allreduce()

    def _start_allreduce(self) -> None:
        grads = list(self._grads.values())
        if self._use_bucketization:
            self._pending_buckets = allreduce_bucketized(
                self._manager, grads, self.bucket_cap_mb, self._should_quantize
            )
        else:
            self._pending_works = [
                self._manager.allreduce(g, should_quantize=self._should_quantize) for g in grads
            ]

    def _wait_allreduce(self) -> None:
        """Waits for the allreduce started by :meth:`_average_grads` (once: later calls return)."""
        works, buckets = self._pending_works, self._pending_buckets
        self._pending_works, self._pending_buckets = [], []
        for work in works:
            work.wait()
        for bucket in buckets:
            bucket.finish()  # copies the reduced bucket back into the pseudo-gradients
        if self._stream is not None:
            self._stream.synchronize()

    def perform_sync(self) -> bool:
        """Finish the allreduce, vote, and apply the outer step on commit; returns the vote."""
        if not self._prepared:
            raise RuntimeError(
                f"{self.state_dict_key}: perform_sync called without a prior prepare_sync"
            )
        self._wait_allreduce()
        self._local_parameters = {
            name: extract_local_tensor(p.data) for name, p in self._model.named_parameters()
        }
        self.restore_parameters()
        committed = self._manager.should_commit()
        if committed:
            self._set_grads()
            self._outer_optimizer.step()
            self.save_parameters()
            self._merge_local_parameters()
        self._outer_optimizer.zero_grad()
        self._grads = {}
        self._local_parameters = {}
        self._prepared = False
        return committed

    def _set_grads(self) -> None:
        """Sets each parameter's ``grad`` to its averaged pseudo-gradient."""
        self._wait_allreduce()
        for name, p in self._model.named_parameters():
            grad = self._grads[name]
            if is_dtensor(p):
                from torch.distributed.tensor import DTensor

                grad = DTensor.from_local(
                    grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            p.grad = grad

    def _merge_local_parameters(self) -> None:
        # p = global + alpha * (local - global); alpha 0 keeps the global weights exactly.
        if self._alpha == 0.0:
            return
        with torch.no_grad():
            for name, p in self._model.named_parameters():
                target = local_view(p)
                target.lerp_(self._local_parameters[name].to(target.device), self._alpha)


class DiLoCo(OptimizerStepHooks):
    """DiLoCo (``n_fragments == 1``) and Streaming DiLoCo (several fragments) over a manager.

    Use as a context manager around the training loop; it hooks ``inner_optimizer.step``.
    The manager must use a synchronous quorum so that a healing replica loads the global
    state before it computes pseudo-gradients.

    Args:
        manager: the fault-tolerance manager (``use_async_quorum=False``).
        model_fragments: modules partitioning the model; one syncs per period.
        inner_optimizer: optimizer over the whole model, stepped every local step.
        outer_optimizer: one optimizer per fragment (list), or one shared by all fragments.
        sync_every: inner steps between two syncs of the same fragment (a multiple of the
            fragment count; fragments take turns every ``sync_every // n_fragments`` steps).
        backup_device: where the global weights live (default CPU).
        pin_memory: pin the CPU backups when CUDA is available.
        use_bucketization: allreduce pseudo-gradients in flat buckets (also enabled by
            ``TORCHHEAL_USE_BUCKETIZATION=True`` / ``TORCHFT_USE_BUCKETIZATION=True``).
        bucket_cap_mb: bucket capacity in MiB (default 1 GiB).
        should_quantize: allreduce through 8-bit quantization.
        fragment_sync_delay: inner steps between starting a fragment's allreduce and applying
            it (overlaps communication with compute); < ``sync_every // n_fragments``.
        fragment_update_alpha: weight of the local weights when merging after a sync, in [0, 1].
    """

    bucket_cap_mb: int = DEFAULT_BUCKET_CAP_BYTES  # bytes, as the reference's attribute
    use_bucketization: bool = False

    def __init__(
        self,
        manager: SyncManager,
        model_fragments: list[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: float | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        n = len(model_fragments)
        refuse_salvage(manager, "DiLoCo")
        if isinstance(outer_optimizer, list) and len(outer_optimizer) != n:
            raise ValueError(
                f"got {len(outer_optimizer)} outer optimizers for {n} model fragments; "
                "pass one per fragment or a single shared one"
            )
        if manager._use_async_quorum:
            raise ValueError(
                "Using DiLoCo require synchronous quorum to be enabled. "
                "Ensure that the manager is initialized with use_async_quorum=False"
            )
        if sync_every < n:
            raise ValueError("Only 1 fragment can be syncrhonized at a time")
        if sync_every % n != 0:
            raise ValueError("sync_every must divide the number of fragments")
        self._period = sync_every // n
        if fragment_sync_delay >= self._period:
            raise ValueError(
                "Fragment must be synced before it is reduced another time: "
                f"fragment_sync_delay ({fragment_sync_delay}) must be smaller than "
                f"sync_every // n_fragments ({self._period})"
            )
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(
                f"fragment_update_alpha must be between 0 and 1, got {fragment_update_alpha}"
            )
        if fragment_sync_delay < 0:
            raise ValueError(f"fragment_sync_delay must be >= 0, got {fragment_sync_delay}")

        self._manager = manager
        self._inner_optimizer = inner_optimizer
        self._hooked_optimizer = inner_optimizer
        self._sync_every = sync_every
        self._fragment_sync_delay = fragment_sync_delay
        self._local_step = 0
        self._hooks = []
        if bucket_cap_mb is not None:
            self.bucket_cap_mb = int(bucket_cap_mb * 1024 * 1024)
        self.use_bucketization = use_bucketization or manager_env.use_bucketization()

        self._fragments = [
            _StreamingDiLoCoFragment(
                manager,
                fragment,
                i,
                outer_optimizer[i] if isinstance(outer_optimizer, list) else outer_optimizer,
                backup_device,
                pin_memory,
                self.use_bucketization,
                self.bucket_cap_mb,
                should_quantize,
                fragment_update_alpha,
            )
            for i, fragment in enumerate(model_fragments)
        ]
        for fragment in self._fragments:
            fragment.save_parameters()
            fragment.register_state_dict_fn()
        # Local models and inner optimizers differ between syncs by design: the divergence
        # guard compares the fragments' global state only (a Manager without a guard: none).
        compare_only = getattr(manager, "compare_only", None)
        if compare_only is not None:
            compare_only([f.state_dict_key for f in self._fragments])

    def _current_fragment(self) -> _StreamingDiLoCoFragment:
        return self._fragments[self._manager.current_step() % len(self._fragments)]

    def _after_step(self) -> None:
        self._local_step += 1
        if self._local_step == self._period - self._fragment_sync_delay:
            # Sync quorum: a healing replica has the global state loaded when this returns,
            # and its manager step (hence the fragment chosen) equals its peers'.
            self._manager.start_quorum()
            self._current_fragment().prepare_sync()
        if self._local_step < self._period:
            return
        if self._local_step != self._period:  # unreachable: the counter resets at the period
            raise RuntimeError(f"local step {self._local_step} ran past period {self._period}")
        self._current_fragment().perform_sync()
        self._local_step = 0
