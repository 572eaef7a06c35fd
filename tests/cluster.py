"""The one harness for tests that run replica groups: a lighthouse, stores, threads, processes.

The test process plays the cluster scheduler and torchrun's agent. It runs the lighthouse
(loopback, port 0), hosts each replica group's TCPStore (a fresh one per incarnation, as a
restarted torchrun job would get) and starts the groups:

* on threads of this process (:func:`replica` for one-rank groups driven step by step;
  :func:`run_groups_on_threads` for groups that run to completion and restart after an
  injected exception);
* as spawned processes (:func:`supervise` restarts a group when its ranks die; a death counts
  as planned only when it is a SIGKILL the group was told to do, anything else fails the test;
  :func:`run_processes` runs plain torch jobs).

Every wait is bounded; only processes this harness started are ever killed.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.distributed import TCPStore

from tests import warm
from torchheal.coordination.lighthouse.server import LighthouseServer
from torchheal.manager import Manager
from torchheal.process_group.gloo import ProcessGroupGloo

T = TypeVar("T")
TIMEOUT = timedelta(seconds=10)


# --- lighthouse and stores -------------------------------------------------------------------


@contextmanager
def lighthouse(min_replicas: int = 1, **kwargs: Any) -> Iterator[LighthouseServer]:
    """A lighthouse on loopback (port 0), shut down on exit.

    Args:
        min_replicas: the lighthouse's ``min_replicas``.
        kwargs: more ``LighthouseServer`` options (``join_timeout_ms``, ...).
    """
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, **kwargs)
    try:
        yield server
    finally:
        server.shutdown()


def url(server: LighthouseServer) -> str:
    """The lighthouse's loopback URL (its ``address()`` names the host, which may not resolve)."""
    return f"http://127.0.0.1:{server.port()}"


def new_store() -> TCPStore:
    """A replica group's TCPStore (master, loopback, port 0)."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


# --- groups on threads -----------------------------------------------------------------------


def run_parallel(*fns: Callable[[], Any], timeout: float = 30.0) -> list[Any]:
    """Runs each function on its own thread (one per replica group); returns their results."""
    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result(timeout=timeout) for f in futures]


@dataclass
class Replica:
    """One replica group of one rank: its Manager and a tiny model state."""

    name: str
    manager: Manager
    pg: Any
    store: TCPStore
    weight: torch.Tensor
    loads: list[int] = field(default_factory=list)  # thread idents of load_state_dict calls
    reads: set[int] = field(default_factory=set)  # thread idents of state_dict calls
    fail_loads: int = 0  # how many next loads raise

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.loads.append(threading.get_ident())
        if self.fail_loads > 0:
            self.fail_loads -= 1
            raise RuntimeError("load_state_dict failed")
        self.weight.copy_(state["weight"])

    def state(self) -> dict[str, torch.Tensor]:
        self.reads.add(threading.get_ident())
        return {"weight": self.weight}


def train_step(r: Replica) -> bool:
    """One step of a group on threads: quorum, an allreduce, the vote."""
    m = r.manager
    m.start_quorum()
    m.allreduce(torch.zeros(3)).wait()
    return m.should_commit()


@contextmanager
def replica(
    lh: LighthouseServer,
    name: str,
    weight: float = 0.0,
    pg: Any = None,
    **manager_kwargs: Any,
) -> Iterator[Replica]:
    """A one-rank replica group named ``name`` on this thread, against lighthouse ``lh``."""
    store = new_store()
    pg = pg if pg is not None else ProcessGroupGloo(timeout=TIMEOUT)
    holder: dict[str, Replica] = {}
    kwargs: dict[str, Any] = dict(
        min_replica_size=1,
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
    )
    kwargs.update(manager_kwargs)
    manager = Manager(
        pg=pg,
        load_state_dict=lambda s: holder["r"].load(s),
        state_dict=lambda: holder["r"].state(),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=url(lh),
        replica_id=name,
        **kwargs,
    )
    r = Replica(name, manager, pg, store, torch.full((3,), float(weight)))
    holder["r"] = r
    try:
        yield r
    finally:
        manager.shutdown(wait=False)


def run_groups_on_threads(
    run: Callable[[int, int], T],
    count: int,
    *,
    restart_on: type[BaseException],
    max_restarts: int,
    deadline_s: float,
) -> list[tuple[T, int]]:
    """Runs group ``i`` as ``run(i, incarnation)`` on its own thread until it returns.

    An exception of type ``restart_on`` is the group's simulated crash: the group runs again as
    the next incarnation. Any other exception fails the test.

    Args:
        run: one incarnation of one group.
        count: the number of groups.
        restart_on: the exception that means "restart this group".
        max_restarts: crashes tolerated per group.
        deadline_s: bound on the whole run.

    Returns:
        per group, ``(what its last incarnation returned, how many times it crashed)``.
    """

    def group(index: int) -> tuple[T, int]:
        crashes = 0
        while True:
            try:
                return run(index, crashes), crashes
            except restart_on:
                crashes += 1
                assert crashes <= max_restarts, f"g{index} crashed {crashes} times"

    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(group, i) for i in range(count)]
        return [f.result(timeout=deadline_s) for f in futures]


# --- groups as processes ---------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """How one replica group runs as processes.

    Args:
        group: the group's index.
        ranks: processes per incarnation.
        planned_kills: how many incarnations end in a SIGKILL the group does to itself; any
            other death, or a SIGKILL beyond these, fails the test.
        start_delay_s: start the group this long after the others (an upscale).
    """

    group: int
    ranks: int = 1
    planned_kills: int = 0
    start_delay_s: float = 0.0


#: ``(group, rank, incarnation, store_port) -> (target, args)`` of one rank's process.
RankStarter = Callable[[int, int, int, int], tuple[Callable[..., None], tuple[Any, ...]]]


@dataclass
class _Running:
    launch: Launch
    procs: list[Any] = field(default_factory=list)
    store: TCPStore | None = None
    incarnation: int = 0
    started: bool = False
    finished: bool = False


def supervise(
    start_rank: RankStarter,
    launches: Sequence[Launch],
    *,
    deadline_s: float,
    max_restarts: int = 3,
) -> dict[int, int]:
    """Runs groups of processes to completion, restarting a group when its ranks die.

    When a rank of a group exits, the group must either be done (every rank exits 0) or have
    died as planned: the ranks that died by themselves were SIGKILLed, in an incarnation below
    ``planned_kills``. Then the group's other ranks are SIGKILLed (as torchrun ends a failed
    job) and the group starts again as the next incarnation with a fresh store.

    Args:
        start_rank: what each rank's process runs.
        launches: the groups.
        deadline_s: bound on the whole run.
        max_restarts: restarts tolerated per group.

    Returns:
        per group, how many times it was restarted.

    Raises:
        AssertionError: the run did not finish in time, a rank died unplanned (its exit code is
            in the message), or a group restarted too often.
    """
    ctx = warm.mp_context()
    groups = {launch.group: _Running(launch) for launch in launches}
    t0 = time.monotonic()

    def start(g: _Running) -> None:
        g.store = new_store()
        g.procs = []
        for rank in range(g.launch.ranks):
            target, args = start_rank(g.launch.group, rank, g.incarnation, g.store.port)
            p = ctx.Process(
                target=target,
                args=args,
                name=f"g{g.launch.group}r{rank}i{g.incarnation}",
                daemon=True,
            )
            p.start()
            g.procs.append(p)
        g.started = True

    def check_death(g: _Running, codes: list[int | None]) -> None:
        died = {rank: code for rank, code in enumerate(codes) if code not in (None, 0)}
        planned = g.incarnation < g.launch.planned_kills
        wrong = {rank: code for rank, code in died.items() if code != -signal.SIGKILL}
        assert planned and not wrong, (
            f"group {g.launch.group} incarnation {g.incarnation}: ranks died with exit codes "
            f"{died} ({'planned SIGKILL expected' if planned else 'no kill was planned'})"
        )

    try:
        while not all(g.finished for g in groups.values()):
            elapsed = time.monotonic() - t0
            assert elapsed < deadline_s, f"job did not finish within {deadline_s}s; " + ", ".join(
                f"g{g.launch.group}: {[p.exitcode for p in g.procs]}" for g in groups.values()
            )
            for g in groups.values():
                if not g.started:
                    if elapsed >= g.launch.start_delay_s:
                        start(g)
                    continue
                if g.finished:
                    continue
                codes = [p.exitcode for p in g.procs]
                if all(code == 0 for code in codes):
                    g.finished = True
                elif any(code not in (None, 0) for code in codes):
                    check_death(g, codes)
                    _kill(g.procs)
                    g.incarnation += 1
                    assert g.incarnation <= max_restarts, (
                        f"group {g.launch.group} restarted {g.incarnation} times"
                    )
                    start(g)
            sentinels = [p.sentinel for g in groups.values() for p in g.procs if p.is_alive()]
            if sentinels:
                multiprocessing.connection.wait(sentinels, timeout=0.2)
            else:
                time.sleep(0.05)  # only while a delayed group waits for its start time
    finally:
        for g in groups.values():
            _kill(g.procs)
    return {g.launch.group: g.incarnation for g in groups.values()}


def run_processes(
    calls: Sequence[tuple[Callable[..., None], tuple[Any, ...]]], deadline_s: float
) -> None:
    """Runs one spawned process per ``(target, args)``; all must exit 0 within ``deadline_s``.

    Args:
        calls: what each process runs.
        deadline_s: bound on the whole run.
    """
    ctx = warm.mp_context()
    procs = [ctx.Process(target=target, args=args, daemon=True) for target, args in calls]
    deadline = time.monotonic() + deadline_s
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        codes = [p.exitcode for p in procs]
        assert codes == [0] * len(procs), f"processes did not finish cleanly: {codes}"
    finally:
        _kill(procs)


def _kill(procs: Sequence[Any]) -> None:
    # SIGKILL only processes this harness started, and reap them.
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if p.pid is not None:
            p.join(timeout=30)
