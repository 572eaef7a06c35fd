"""The Manager: the per-step fault-tolerance lifecycle that runs on every rank.

One step is ``start_quorum`` -> forward/backward with ``allreduce`` -> ``should_commit``:

* ``start_quorum`` asks this replica group's ManagerServer for a quorum (in the background
  when ``use_async_quorum``), reconfigures the cross-replica process group when the quorum id
  changed, and sends or receives the live state of a replica that is behind.
* ``allreduce`` sums over the participating replicas and divides by their count; a failure is
  recorded (``report_error``) instead of raised, and every later collective of the step is a
  no-op.
* ``should_commit`` is the replica group's vote: any error anywhere in the group means nobody
  steps the optimizer.

Deliberate difference from the reference: the user's ``state_dict``/``load_state_dict``
functions run only on the training thread (the thread calling ``start_quorum``/``should_commit``).
``start_quorum`` captures ``_manager_state_dict()`` (tensor references, cheap) before handing the
quorum to the background thread, which only moves those tensors; state received by a healing
replica is loaded on the training thread (in ``start_quorum`` with synchronous quorum, in
``should_commit`` with asynchronous quorum). The reference calls them from its quorum thread
during the forward pass, which breaks FSDP2/DTensor models.

Errors: a quorum RPC error (timeout, lighthouse unreachable, not in the quorum) and a
``should_commit`` RPC error are raised; any other failure in a step (process-group
reconfiguration, checkpoint transfer, a collective) is reported and makes the step not commit.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.distributed import AllreduceOptions, ReduceOp, TCPStore

from torchheal._base.config import (
    CONNECT_TIMEOUT_SEC_ENV,
    MANAGER_PORT_ENV,
    QUORUM_RETRIES_ENV,
    QUORUM_TIMEOUT_SEC_ENV,
    TIMEOUT_SEC_ENV,
    EnvConfig,
    ManagerTimeouts,
    TimeoutBudgetWarning,
    get_timeout,
    timeout_budget_problems,
)
from torchheal.checkpointing import CheckpointTransport, HTTPTransport
from torchheal.checkpointing.rwlock import RWLock
from torchheal.coordination.client import ManagerClient
from torchheal.coordination.manager_server import ManagerServer
from torchheal.coordination.types import QuorumResult
from torchheal.futures import future_timeout
from torchheal.manager.healing import _HealingMixin
from torchheal.manager.rules import (
    WorldSizeMode,
    commit_failures_exceeded,
    local_commit_vote,
    participation,
)
from torchheal.process_group.work import _DummyWork
from torchheal.work import _ManagedWork

try:
    from torchheal.collectives import allreduce_quantized

    # Name kept from the reference; our quantized collectives need no triton.
    IS_TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover - collectives ships with torchheal
    IS_TRITON_AVAILABLE = False

__all__ = [
    "CONNECT_TIMEOUT_SEC_ENV",
    "MANAGER_ADDR_KEY",
    "MANAGER_PORT_ENV",
    "QUORUM_RETRIES_ENV",
    "QUORUM_TIMEOUT_SEC_ENV",
    "REPLICA_ID_KEY",
    "TIMEOUT_SEC_ENV",
    "ExceptionWithTraceback",
    "Manager",
    "WorldSizeMode",
    "get_timeout",
]

MANAGER_ADDR_KEY: str = "manager_addr"
REPLICA_ID_KEY: str = "replica_id"

T = TypeVar("T")

# The package name, so users configuring "torchheal.manager" logging see these lines.
logger: logging.Logger = logging.getLogger("torchheal.manager")


class ExceptionWithTraceback(Exception):
    """An error reported during a step, with the stack trace where it happened.

    Args:
        e: the original exception.
    """

    def __init__(self, e: Exception) -> None:
        self.original_exception = e
        if e.__traceback__ is not None:
            self.stack_trace: str = "".join(traceback.format_exception(e))
        else:
            # Reported without being raised: the caller's stack says where.
            self.stack_trace = "".join(traceback.format_stack()[:-1])
        super().__init__(f"{e}\n{self.stack_trace}")


class _ManagerLogger:
    """Prefixes every line with ``[{replica_id}/{group_rank} - step {step}]``."""

    def __init__(self, manager: Manager, replica_id: str, group_rank: int) -> None:
        self._manager = manager
        self._replica_id = replica_id
        self._group_rank = group_rank

    def prefix(self) -> str:
        return f"[{self._replica_id}/{self._group_rank} - step {self._manager.current_step()}]"

    def log(self, level: int, msg: str, *args: object) -> None:
        """Logs ``msg % args``; nothing is formatted when ``level`` is disabled (per-step lines)."""
        if logger.isEnabledFor(level):
            logger.log(level, "%s %s", self.prefix(), msg % args if args else msg)

    def info(self, msg: str) -> None:
        logger.info("%s %s", self.prefix(), msg)

    def warning(self, msg: str) -> None:
        logger.warning("%s %s", self.prefix(), msg)

    def exception(self, msg: str) -> None:
        logger.exception("%s %s", self.prefix(), msg)


def _host_port(host: str, port: int) -> str:
    # IPv6 literals need brackets in "host:port".
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


class Manager(_HealingMixin):
    """Manages the fault-tolerant training loop of one rank of one replica group.

    The replica group's TCPStore must already run at ``store_addr:store_port`` (torchrun
    provides it); group rank 0 starts the ManagerServer and publishes its address there.
    Save and restore ``Manager.state_dict()`` with the user state for periodic checkpoints.

    Args:
        pg: the cross-replica process group (reconfigured on every new quorum).
        load_state_dict: loads the user state received when healing (training thread only).
        state_dict: returns the user state to send to a healing peer (training thread only).
        min_replica_size: fewest participating replicas with which a step may commit.
        use_async_quorum: run the quorum in the background during the forward pass.
        timeout: collectives, should_commit, checkpoint transfer, state-dict lock, wrap_future.
        quorum_timeout: how long a quorum may take (longer than a step; see the budget warning).
        connect_timeout: establishing RPC connections to the ManagerServer and lighthouse.
        rank: group rank (``RANK`` when None).
        world_size: group world size (``WORLD_SIZE`` when None).
        world_size_mode: DYNAMIC or FIXED_WITH_SPARES.
        store_addr: the replica group's TCPStore host (``MASTER_ADDR`` when None).
        store_port: the replica group's TCPStore port (``MASTER_PORT`` when None).
        lighthouse_addr: group rank 0: the lighthouse (``TORCHHEAL_LIGHTHOUSE`` /
            ``TORCHFT_LIGHTHOUSE`` when None).
        replica_id: group rank 0: this replica group's name (a uuid is appended).
        port: group rank 0: ManagerServer port (``*_MANAGER_PORT`` env, else ephemeral).
        hostname: group rank 0: the host name advertised to peers.
        heartbeat_interval: how often the ManagerServer heartbeats the lighthouse.
        checkpoint_transport: moves state to healing peers (HTTPTransport when None).
        init_sync: synchronise weights from a primary at step 0 (False if seeded identically).
        max_retries: consecutive failed commits tolerated before ``should_commit`` raises.
        quorum_retries: lighthouse quorum retries in the ManagerServer.
    """

    def __init__(
        self,
        pg: Any,
        load_state_dict: Callable[[T], None] | None,
        state_dict: Callable[[], T] | None,
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
        rank: int | None = None,
        world_size: int | None = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: str | None = None,
        store_port: int | None = None,
        lighthouse_addr: str | None = None,
        replica_id: str | None = None,
        port: int | None = None,
        hostname: str = socket.gethostname(),
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: CheckpointTransport[dict[str, T]] | None = None,
        init_sync: bool = True,
        max_retries: int | None = None,
        quorum_retries: int = 0,
    ) -> None:
        env = EnvConfig.from_env()
        timeouts = ManagerTimeouts.resolve(
            env, timeout, quorum_timeout, connect_timeout, quorum_retries
        )
        problems = timeout_budget_problems(timeouts, heartbeat_interval)
        if problems:
            warnings.warn(
                "timeout budget: a failure may kill this replica instead of healing it: "
                + "; ".join(problems),
                TimeoutBudgetWarning,
                stacklevel=2,
            )
        self._timeouts = timeouts
        self._timeout: timedelta = timeouts.timeout
        self._quorum_timeout: timedelta = timeouts.quorum_timeout
        self._connect_timeout: timedelta = timeouts.connect_timeout
        self._quorum_retries: int = timeouts.quorum_retries

        self._load_state_dict_fns: dict[str, Callable[[Any], None]] = {}
        self._user_state_dicts: dict[str, Callable[[], Any]] = {}
        self._replica_id = replica_id
        self._state_dict_lock = RWLock(timeout=self._timeout.total_seconds())
        self._is_state_dict_read_allowed = True
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        if min_replica_size < 1:
            raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")
        self._min_replica_size = min_replica_size
        self._use_async_quorum = use_async_quorum
        self._replica_world_size_mode = world_size_mode
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._commit_failures = 0

        store_addr = store_addr or os.environ["MASTER_ADDR"]
        store_port = store_port or int(os.environ["MASTER_PORT"])
        self._group_rank: int = rank if rank is not None else int(os.environ["RANK"])
        group_world_size = world_size or int(os.environ["WORLD_SIZE"])
        self._group_world_size: int = group_world_size

        if checkpoint_transport is None:
            checkpoint_transport = HTTPTransport(timeout=self._timeout, num_chunks=0)
        self._checkpoint_transport: CheckpointTransport[Any] = checkpoint_transport

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="async_quorum")
        self._quorum_future: ConcurrentFuture[None] | None = None
        # The quorum future whose error already reached the training loop (see start_quorum).
        self._raised_quorum_future: ConcurrentFuture[None] | None = None
        # The store client outlives rank 0's ManagerServer start-up (bounded by connect_timeout).
        store_timeout = max(timedelta(seconds=300), 2 * self._connect_timeout)
        self._store = TCPStore(
            host_name=store_addr,
            port=store_port,
            is_master=False,
            wait_for_workers=False,
            timeout=store_timeout,
        )
        self._pg = pg
        self._manager: ManagerServer | None = None
        self._recovery_stream: torch.cuda.Stream | None = (
            torch.cuda.Stream() if torch.cuda.is_available() else None
        )
        self._recovery_event: torch.cuda.Event | None = None

        if self._group_rank == 0:
            if port is None:
                port = env.manager_port if env.manager_port is not None else 0
            lighthouse_addr = lighthouse_addr or env.lighthouse
            if not lighthouse_addr:
                raise ValueError(
                    "no lighthouse address: pass lighthouse_addr or set TORCHHEAL_LIGHTHOUSE "
                    "(or TORCHFT_LIGHTHOUSE)"
                )
            # A fresh uuid per start so a fast restart never reuses a replica id.
            new_uuid = str(uuid.uuid4())
            full_replica_id = f"{replica_id}:{new_uuid}" if replica_id else new_uuid
            self._manager = ManagerServer(
                replica_id=full_replica_id,
                lighthouse_addr=lighthouse_addr,
                hostname=hostname,
                bind=f"[::]:{port}",
                store_addr=_host_port(store_addr, store_port),
                world_size=group_world_size,
                heartbeat_interval=heartbeat_interval,
                connect_timeout=self._connect_timeout,
                quorum_retries=self._quorum_retries,
            )
            self._store.set(MANAGER_ADDR_KEY, self._manager.address())
            self._store.set(REPLICA_ID_KEY, full_replica_id)

        addr = self._store.get(MANAGER_ADDR_KEY).decode("utf-8")
        # Group rank 0 too: connecting checks at start-up that the advertised address works.
        self._client = ManagerClient(addr, connect_timeout=self._connect_timeout)
        # Group rank 0 owns the ManagerServer, so it joins the quorum and votes in-process (the
        # handlers' own coroutines on the server's loop, same deadlines and errors) instead of
        # a gRPC round trip to itself; the other ranks go through gRPC.
        self._quorum_rpc: Callable[..., QuorumResult] = (
            self._manager.quorum_in_process if self._manager is not None else self._client._quorum
        )
        self._should_commit_rpc: Callable[..., bool] = (
            self._manager.should_commit_in_process
            if self._manager is not None
            else self._client.should_commit
        )
        self._full_replica_id: str = self._store.get(REPLICA_ID_KEY).decode("utf-8")
        self._logger = _ManagerLogger(self, self._full_replica_id, self._group_rank)

        self._step = 0
        self._quorum_id = -1
        self._errored: ExceptionWithTraceback | None = None
        self._healing = False
        self._pending_state_dict: dict[str, Any] | None = None
        # Manager state before a heal overwrote it; restored if loading the user state fails.
        self._pre_heal_state: dict[str, int] | None = None
        self._pending_work: list[torch.futures.Future[Any]] = []
        self._outstanding_works: list[_ManagedWork] = []
        self._batches_committed = 0
        self._participating_replica_rank: int | None = None
        self._participating_replica_world_size: int = 0

    # -- step lifecycle -----------------------------------------------------------------

    def start_quorum(
        self,
        allow_heal: bool = True,
        shrink_only: bool = False,
        timeout: timedelta | None = None,
    ) -> None:
        """Begins a step: computes a quorum (in the background unless synchronous) and heals.

        All replicas must pass the same ``allow_heal``.

        Args:
            allow_heal: send/receive state to/from peers that are behind this step.
            shrink_only: ask the lighthouse not to admit new replicas this step.
            timeout: quorum timeout for this step (``quorum_timeout`` when None).

        Raises:
            TimeoutError, RuntimeError: the quorum RPC failed (synchronous quorum, or a previous
                quorum error nobody has observed yet).
        """
        previous = self._quorum_future
        if previous is not None:
            error = previous.exception()
            if error is not None and previous is not self._raised_quorum_future:
                self._raised_quorum_future = previous
                raise error
        self._errored = None
        self._healing = False
        self._pending_state_dict = None
        self._pre_heal_state = None
        self._pending_work = []
        self._outstanding_works = []

        # Capture what a healing peer would receive on this (the training) thread.
        captured = self._capture_state_dict() if allow_heal else None
        self._quorum_future = self._executor.submit(
            self._async_quorum,
            allow_heal=allow_heal,
            shrink_only=shrink_only,
            quorum_timeout=timeout or self._quorum_timeout,
            curr_device=torch.cuda.current_device() if torch.cuda.is_available() else -1,
            step=self._step,
            captured=captured,
        )
        if not self._use_async_quorum:
            self.wait_quorum()
            if self._healing:
                # Load before the forward pass; this replica then contributes like the others.
                self._apply_pending_state_dict()
                self._healing = False

    def wait_quorum(self) -> None:
        """Waits for the in-flight quorum; re-raises its error.

        Raises:
            TimeoutError, RuntimeError: the quorum RPC failed.
        """
        future = self._quorum_future
        assert future is not None, "must call start_quorum before wait_quorum"
        try:
            future.result()
        except BaseException:
            self._raised_quorum_future = future
            raise

    def _async_quorum(
        self,
        allow_heal: bool,
        shrink_only: bool,
        quorum_timeout: timedelta,
        curr_device: int,
        step: int,
        captured: dict[str, Any] | None,
    ) -> None:
        if curr_device >= 0 and torch.cuda.is_available():
            torch.cuda.set_device(curr_device)
        # Quorum RPC errors propagate: they are raised to the training loop.
        quorum = self._quorum_rpc(
            group_rank=self._group_rank,
            step=step,
            checkpoint_metadata=self._checkpoint_transport.metadata(),
            shrink_only=shrink_only,
            init_sync=self._init_sync,
            commit_failures=self._commit_failures,
            timeout=quorum_timeout,
        )
        try:
            self._apply_quorum(quorum, allow_heal)
        except Exception as e:
            self._logger.exception(f"applying quorum {quorum.quorum_id} failed: {e}")
            self.report_error(e)
            return
        if allow_heal:
            self._recover(quorum, captured)

    def _apply_quorum(self, quorum: QuorumResult, allow_heal: bool) -> None:
        rank, world_size = participation(
            quorum,
            self._use_async_quorum,
            allow_heal,
            self._replica_world_size_mode,
            self._min_replica_size,
        )
        self._participating_replica_rank = rank
        self._participating_replica_world_size = world_size
        if quorum.quorum_id == self._quorum_id:
            return
        self._logger.info(
            f"new quorum {quorum.quorum_id}: replica rank {quorum.replica_rank} of "
            f"{quorum.replica_world_size} {list(quorum.replica_ids)}, max_step "
            f"{quorum.max_step}, participating rank {rank} of {world_size}, heal={quorum.heal}"
            + (
                f" from replica rank {quorum.recover_src_replica_rank}"
                f" ({quorum.recover_src_manager_address})"
                if quorum.heal
                else ""
            )
            + (
                f", sending to replica ranks {list(quorum.recover_dst_replica_ranks)}"
                if quorum.recover_dst_replica_ranks
                else ""
            )
        )
        store_prefixed_addr = (
            f"{quorum.store_address}/torchft/{quorum.quorum_id}/{self._group_rank}"
        )
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        # A failure propagates to _async_quorum: reported, quorum id unchanged so the next
        # step reconfigures again.
        self._pg.configure(
            store_prefixed_addr,
            self._replica_id or "0",
            quorum.replica_rank,
            quorum.replica_world_size,
        )
        self._quorum_id = quorum.quorum_id

    # -- collectives --------------------------------------------------------------------

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp = ReduceOp.AVG,
    ) -> torch.distributed.Work:
        """Fault-tolerant allreduce across the participating replicas, in place.

        AVG is a SUM divided by the number of participating replicas. Errors are not raised:
        they are reported, the returned work completes with the (garbage) tensor, and every
        later allreduce of the step is a no-op.

        Args:
            tensor: the tensor to reduce in place.
            should_quantize: send 8-bit quantized data (SUM/AVG only).
            reduce_op: the reduction; AVG needs a floating point tensor.

        Raises:
            ValueError: AVG on a non-floating point tensor.
            TimeoutError, RuntimeError: the quorum of this step failed.
        """
        if self.errored():
            return _DummyWork(tensor)
        self.wait_quorum()
        num_participants = self.num_participants()
        is_avg = reduce_op == ReduceOp.AVG
        if is_avg and not tensor.is_floating_point():
            raise ValueError("average reduce op is only supported for floating point tensors")
        if not self.is_participating():
            # Healing replicas and spares contribute zeros but stay in lock-step.
            tensor.zero_()
        pg_op = ReduceOp.SUM if is_avg else reduce_op
        try:
            if should_quantize and IS_TRITON_AVAILABLE:
                stream = torch.cuda.current_stream() if torch.cuda.is_available() else None
                work = allreduce_quantized([tensor], pg_op, self._pg, stream)
            else:
                opts = AllreduceOptions()
                opts.reduceOp = pg_op
                work = self._pg.allreduce([tensor], opts)
        except Exception as e:
            self._logger.exception(f"allreduce failed to start, skipping the step: {e}")
            self.report_error(e)
            return _DummyWork(tensor)

        managed = _ManagedWork(self, work, tensor)

        def normalize(fut: torch.futures.Future[Any]) -> torch.Tensor:
            fut.value()  # surfaces an error of the collective
            if is_avg and num_participants > 0:
                tensor.div_(num_participants)
            return tensor

        managed.get_future().then(normalize)
        self._outstanding_works.append(managed)
        return managed

    def report_error(self, e: Exception) -> None:
        """Marks this step as failed: it will not commit, and the PG is rebuilt next step.

        Args:
            e: what failed.
        """
        self._logger.warning(f"step failed: {type(e).__name__}: {e}")
        self._errored = ExceptionWithTraceback(e)

    def errored(self) -> ExceptionWithTraceback | None:
        """Returns the error reported in this step, or None."""
        return self._errored

    def wrap_future(
        self,
        fut: torch.futures.Future[T],
        default: T,
        timeout: timedelta | None = None,
    ) -> torch.futures.Future[T]:
        """Adds a timeout to ``fut`` and swallows its error into ``report_error``.

        Args:
            fut: the future to wrap.
            default: the value the returned future holds when ``fut`` fails or times out.
            timeout: defaults to the manager's ``timeout``.
        """
        fut = future_timeout(fut, timeout or self._timeout)

        def callback(f: torch.futures.Future[T]) -> T:
            try:
                return f.value()
            except Exception as e:
                self._logger.exception(f"future failed, skipping the step: {e}")
                self.report_error(e)
                return default

        wrapped = fut.then(callback)
        self._pending_work.append(wrapped)
        return wrapped

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """The replica group's vote on this step; advances the step on success.

        Call after backward and before stepping the optimizer, on every rank of the group;
        step the optimizer only when it returns True.

        Args:
            timeout: the RPC timeout (the manager's ``timeout`` when None).

        Raises:
            RuntimeError: the RPC failed, or ``max_retries`` consecutive failures were exceeded.
            TimeoutError: the RPC timed out.
        """
        # Every collective of this step must have landed (or failed) before we vote.
        for work in self._outstanding_works:
            if self._errored is not None:
                break
            if not work._waited:
                work.wait()
        for fut in self._pending_work:
            if self._errored is not None:
                break
            fut.wait()  # never raises: wrap_future swallowed the error
        self._outstanding_works = []
        self._pending_work = []
        if self._recovery_event is not None:
            self._recovery_event.synchronize()
            self._recovery_event = None
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()

        pg_error = self._pg.errored()
        if pg_error is not None:
            self.report_error(pg_error)
        if self._healing:
            self._apply_pending_state_dict()

        num_participants = self.num_participants()
        local = local_commit_vote(
            num_participants, self._min_replica_size, self._errored is not None
        )
        decision = self._should_commit_rpc(
            group_rank=self._group_rank,
            step=self._step,
            should_commit=local,
            timeout=timeout or self._timeout,
        )
        # Every step, so a commit logs at DEBUG (formatted only when enabled); a skipped step at
        # INFO.
        self._logger.log(
            logging.DEBUG if decision else logging.INFO,
            "should_commit=%s (local vote %s: %d participants, min %d, errored=%s)",
            decision,
            local,
            num_participants,
            self._min_replica_size,
            self._errored is not None,
        )
        self._checkpoint_transport.disallow_checkpoint()
        if decision:
            self._step += 1
            self._batches_committed += num_participants
            self._commit_failures = 0
        else:
            self._commit_failures += 1
            message = commit_failures_exceeded(self._commit_failures, self._max_retries)
            if message is not None:
                self._logger.warning(message)
                raise RuntimeError(message)
        return decision

    # -- manager state --------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restores the step and batch counters (from a checkpoint or a healing peer).

        Args:
            state_dict: ``{"step": int, "batches_committed": int}``.
        """
        self._step = state_dict["step"]
        self._batches_committed = state_dict["batches_committed"]

    def state_dict(self) -> dict[str, int]:
        """Returns ``{"step", "batches_committed"}``; checkpoint it with the user state."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    # -- queries ---------------------------------------------------------------------------

    def current_step(self) -> int:
        """Returns the number of committed steps (the first step is 0)."""
        return self._step

    def batches_committed(self) -> int:
        """Returns the total batches committed over all steps and participating replicas."""
        return self._batches_committed

    def participating_rank(self) -> int | None:
        """Returns this replica's rank among the participants, None if not participating.

        Waits for the in-flight quorum; None before any quorum.
        """
        if self._quorum_future is None:
            return None
        self.wait_quorum()
        return self._participating_replica_rank

    def num_participants(self) -> int:
        """Returns the number of replicas contributing to this step (0 before any quorum).

        Waits for the in-flight quorum.
        """
        if self._quorum_future is None:
            return 0
        self.wait_quorum()
        assert self._participating_replica_world_size >= 0, "internal error"
        return self._participating_replica_world_size

    def is_participating(self) -> bool:
        """False for a spare, a replica outside the participants, or one still healing."""
        if self._participating_replica_rank is None:
            return False
        if self._healing:
            assert self._use_async_quorum
            return False
        return True

    def shutdown(self, wait: bool = True) -> None:
        """Stops the checkpoint transport, the ManagerServer and the quorum thread.

        The process group is left alone (its owner shuts it down).

        Args:
            wait: wait for background work to finish.
        """
        self._checkpoint_transport.shutdown(wait=wait)
        self._client.close()
        if self._manager is not None:
            self._manager.shutdown()
        self._executor.shutdown(wait=wait)
