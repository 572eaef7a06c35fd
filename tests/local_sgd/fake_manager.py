"""In-process stand-ins for the Manager, for testing the LocalSGD/DiLoCo algorithms.

``FakeManager`` is one replica group alone: its allreduce applies a given function (the
average of one replica is the identity) when the work is waited, its commit decisions are
scripted. ``FakeCluster`` + ``ClusterManager`` are several replica groups on threads: the
quorum is a rendezvous of every live replica, with the reference's recovery plan reduced to
what one-rank groups need (members behind ``max_step`` — and, with init_sync at step 0, all but
the first member — load the state an up-to-date member captured when it joined), and the
allreduce averages the replicas' tensors.

Both follow the manager contract the algorithms rely on: ``allreduce`` returns a Work that
reduces in place when waited and whose future resolves to the tensor; ``should_commit``
advances ``current_step`` on success; ``register_state_dict_fn`` registers what healing loads;
``_use_async_quorum`` is an attribute.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

WAIT_TIMEOUT_S = 10.0


class _LazyWork(dist.Work):
    """A Work that runs ``complete`` once, when first waited, and resolves to ``tensor``."""

    def __init__(self, tensor: torch.Tensor, complete: Callable[[], None]) -> None:
        super().__init__()
        self._tensor = tensor
        self._complete = complete
        self._fut: torch.futures.Future = torch.futures.Future()
        self._lock = threading.Lock()

    def _run(self) -> None:
        with self._lock:
            if not self._fut.done():
                self._complete()
                self._fut.set_result(self._tensor)

    def wait(self, timeout: object = None) -> bool:
        self._run()
        return True

    def get_future(self) -> torch.futures.Future:
        self._run()
        return self._fut


class FakeManager:
    """One replica group alone, with counters, a scripted vote and an allreduce transform.

    Args:
        allreduce_fn: applied in place to each allreduced tensor when its work is waited
            (identity = the average over a single replica).
        commits: successive should_commit decisions; True once exhausted.
        use_async_quorum: value of ``_use_async_quorum``.
    """

    def __init__(
        self,
        allreduce_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        commits: list[bool] | None = None,
        use_async_quorum: bool = False,
    ) -> None:
        self._allreduce_fn = allreduce_fn or (lambda t: t)
        self._commits = list(commits or [])
        self._use_async_quorum = use_async_quorum
        self._step = 0
        self.quorum_calls = 0
        self.commit_calls = 0
        self.allreduce_calls = 0
        self.allreduce_sizes: list[int] = []
        self.quantized_calls = 0
        self.state_dict_fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self.state_dict_read_allowed = True
        self.events: list[str] = []

    def start_quorum(self) -> None:
        self.quorum_calls += 1
        self.events.append("start_quorum")

    def should_commit(self) -> bool:
        self.commit_calls += 1
        decision = self._commits.pop(0) if self._commits else True
        self.events.append(f"should_commit:{decision}")
        if decision:
            self._step += 1
        return decision

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> dist.Work:
        self.allreduce_calls += 1
        self.allreduce_sizes.append(tensor.numel())
        self.quantized_calls += int(should_quantize)
        self.events.append("allreduce")
        sent = tensor.detach().clone()  # a collective reads its input when issued

        def complete() -> None:
            with torch.no_grad():
                tensor.copy_(self._allreduce_fn(sent))

        return _LazyWork(tensor, complete)

    def current_step(self) -> int:
        return self._step

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        assert key not in self.state_dict_fns, f"duplicate state dict key {key}"
        self.state_dict_fns[key] = (load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        self.state_dict_read_allowed = True

    def disallow_state_dict_read(self) -> None:
        self.state_dict_read_allowed = False
        self.events.append("disallow_state_dict_read")

    def capture_state(self) -> dict[str, Any]:
        """What a healthy manager would send to a healer (a deep copy, as bytes would be)."""
        return {
            "user": {k: copy.deepcopy(fns[1]()) for k, fns in self.state_dict_fns.items()},
            "torchft": {"step": self._step},
        }

    def load_captured_state(self, state: dict[str, Any]) -> None:
        """Heal from another manager's :meth:`capture_state`."""
        for key, (load_fn, _) in self.state_dict_fns.items():
            load_fn(state["user"][key])
        self._step = state["torchft"]["step"]


class FakeCluster:
    """Shared rendezvous of ``num_replicas`` one-rank replica groups (threads)."""

    def __init__(self, num_replicas: int, init_sync: bool = True) -> None:
        self.num_replicas = num_replicas
        self.init_sync = init_sync
        self._cond = threading.Condition()
        self._round = 0
        self._joined: dict[str, tuple[int, dict[str, Any]]] = {}
        self._results: dict[int, dict[str, Any]] = {}
        self._reductions: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def _wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        if not self._cond.wait_for(predicate, timeout=WAIT_TIMEOUT_S):
            raise TimeoutError(f"fake cluster: timed out waiting for {what}")

    def quorum(self, replica_id: str, step: int, state: dict[str, Any]) -> tuple[int, Any]:
        """Join the current round; returns (round id, state to heal from or None)."""
        with self._cond:
            round_id = self._round
            self._joined[replica_id] = (step, state)
            if len(self._joined) == self.num_replicas:
                self._results[round_id] = self._plan(self._joined)
                self._joined = {}
                self._round += 1
                self._cond.notify_all()
            else:
                self._wait_for(lambda: round_id in self._results, f"quorum round {round_id}")
            return round_id, self._results[round_id]["heal"].get(replica_id)

    def _plan(self, joined: dict[str, tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        ids = sorted(joined)
        max_step = max(step for step, _ in joined.values())
        up_to_date = [r for r in ids if joined[r][0] == max_step]
        primary = up_to_date[0]
        force = self.init_sync and max_step == 0
        heal = {}
        for r in ids:
            if joined[r][0] != max_step or (force and r != primary):
                heal[r] = joined[primary][1]
        return {"heal": heal, "participants": ids}

    def contribute(self, round_id: int, seq: int, replica_id: str, tensor: torch.Tensor) -> None:
        """Deposit this replica's input of allreduce number ``seq`` of round ``round_id``."""
        with self._cond:
            self._reductions.setdefault((round_id, seq), {})[replica_id] = tensor.detach().clone()
            self._cond.notify_all()

    def average(self, round_id: int, seq: int, out: torch.Tensor) -> None:
        """Wait for every replica's input of that allreduce; write their average into ``out``."""
        key = (round_id, seq)
        with self._cond:
            slot = self._reductions[key]
            self._wait_for(lambda: len(slot) == self.num_replicas, f"allreduce {key}")
            total = torch.stack([slot[r] for r in sorted(slot)]).sum(dim=0)
        with torch.no_grad():
            out.copy_(total / self.num_replicas)


class ClusterManager(FakeManager):
    """One replica group of a :class:`FakeCluster`, in synchronous-quorum mode."""

    def __init__(self, cluster: FakeCluster, replica_id: str) -> None:
        super().__init__(use_async_quorum=False)
        self._cluster = cluster
        self._replica_id = replica_id
        self._round = -1
        self._seq = 0

    def start_quorum(self) -> None:
        super().start_quorum()
        round_id, heal_from = self._cluster.quorum(
            self._replica_id, self._step, self.capture_state()
        )
        self._round, self._seq = round_id, 0
        if heal_from is not None:
            self.load_captured_state(heal_from)

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False) -> dist.Work:
        self.allreduce_calls += 1
        round_id, seq = self._round, self._seq
        self._seq += 1
        self._cluster.contribute(round_id, seq, self._replica_id, tensor)
        return _LazyWork(tensor, lambda: self._cluster.average(round_id, seq, tensor))
