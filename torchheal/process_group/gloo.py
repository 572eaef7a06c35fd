"""Reconfigurable Gloo process group (CPU, and CUDA tensors through Gloo where built).

``abort()`` cuts the group's connections (``gloo_sockets.py``): Gloo's own abort does not
interrupt an operation blocked on a frozen peer. A build that is abandoned or outlasts the
timeout ends its waits for peers (Gloo alone would wait five times the timeout).
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroupGloo as _C10dGloo

from torchheal.process_group.gloo_sockets import PairSockets, end_pair_connects, new_listeners
from torchheal.process_group.wrappers import ProcessGroupWrapper

logger = logging.getLogger(__name__)


def create_gloo_pg(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: timedelta,
    group_name: str | None = None,
    global_ranks: list[int] | None = None,
) -> dist.ProcessGroup:
    """Builds a c10d process group backed by a fresh Gloo backend, once every peer connected."""
    pg = dist.ProcessGroup(store, rank, world_size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend = _C10dGloo(store, rank, world_size, timeout)
    backend._set_sequence_number_for_group()
    if global_ranks:
        backend.options.global_ranks_in_group = list(global_ranks)
    if group_name:
        backend.options.group_name = group_name
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


class _GlooBuild:
    """A Gloo group being built: its pairs' waits may be ended from any thread."""

    def __init__(self, before: frozenset[int], world_size: int) -> None:
        self.before = before
        self.world_size = world_size
        #: Why its pairs' waits were ended (None: they were not): the group built is broken.
        self.ended: str | None = None
        self._done: set[int] = set()  # the listening ports handled
        self._lock = threading.Lock()

    def end_connects(self, why: str) -> bool:
        """Ends its pairs' waits for peers; whether any listener was handled now."""
        with self._lock:
            listeners = [a for a in new_listeners(self.before) if a[1] not in self._done]
            if not listeners:
                return False
            # Said before the first hang-up: the build may complete on it at once.
            self.ended = self.ended or why
            self._done.update(port for _host, port in listeners)
            end_pair_connects(listeners, self.world_size)
            return True


class ProcessGroupGloo(ProcessGroupWrapper):
    """A Gloo process group rebuilt from scratch on every ``configure``.

    Args:
        timeout: rendezvous timeout and timeout of every operation.
    """

    # Gloo's destructor joins workers that a closed peer does not always wake (docs/failures.md).
    _releases_elsewhere = True

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._pair_sockets: PairSockets | None = None
        self._building: _GlooBuild | None = None  # for abandon_configure on another thread

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        build = _GlooBuild(PairSockets.before(), world_size)
        self._building = build
        # Gloo waits for a pair's peer five times the group's timeout: past it, stop waiting.
        watchdog = threading.Timer(self._timeout.total_seconds(), self._overran, args=(build,))
        watchdog.daemon = True
        watchdog.start()
        try:
            pg = create_gloo_pg(
                store, rank, world_size, self._timeout, self._c10d_group_name, self._global_ranks
            )
        finally:
            watchdog.cancel()
            self._building = None
        if build.ended is not None:
            # A pair may have taken a connection we hung up and completed: the group is broken.
            raise RuntimeError(f"the Gloo group's build was given up: {build.ended}")
        self._pair_sockets = PairSockets.after(build.before, world_size)
        return pg

    def _overran(self, build: _GlooBuild) -> None:
        if self._building is build and build.end_connects("it outlasted its timeout"):
            logger.warning(
                "the Gloo group's build outlasted its timeout (%.0f s) waiting for a peer to "
                "connect: it fails now (Gloo would wait five times as long)",
                self._timeout.total_seconds(),
            )

    def abandon_configure(self) -> None:
        """See :meth:`ProcessGroup.abandon_configure`; a build past its store exchange fails too."""
        super().abandon_configure()
        build = self._building
        if build is not None and build.end_connects("abandoned"):
            logger.info("abandoning the Gloo group's build: its pending connects were ended")

    def abort(self, errored: bool = True) -> None:
        """Aborts the group (from any thread): an operation in flight fails at once.

        Args:
            errored: whether this abort is due to a failure (emits a ``torchft_errors`` record).
        """
        sockets, self._pair_sockets = self._pair_sockets, None
        if sockets is not None:
            logger.info("aborting the Gloo group: cut %d connection(s)", sockets.cut())
        elif errored and self._pg is not None:
            logger.warning(
                "aborting the Gloo group without cutting its connections (they could not be "
                "told apart when it was built): an operation in flight ends only at its timeout"
            )
        super().abort(errored)

    def getBackendName(self) -> str:
        """``"torchft-gloo"``."""
        return "torchft-gloo"

    def reduce_scatter(self, output_tensors, input_tensors, opts) -> dist.Work:
        """Not supported by Gloo: raises ``RuntimeError``."""
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter.")

    def reduce_scatter_tensor_coalesced(self, output_tensors, input_tensors, opts) -> dist.Work:
        """Not supported by Gloo: raises ``RuntimeError``."""
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter_tensor_coalesced.")
