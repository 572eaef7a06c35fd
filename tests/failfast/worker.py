"""One replica group (or one rank of one) of the fail-fast tests, run as its own process.

    python -m tests.failfast.worker --group G --incarnation I --groups N --lighthouse URL \
        --target-file F --out OUT [--impl torchheal|torchft] \
        [--hold-after N] [--die-after N] [--die-before-reducing N] [--die-at-join] \
        [--fail-reduce N] [--hold-reduced N] [--hold-in-heal] [--fail-heal] [--stop-at-rejoin] \
        [--fail-build-at-join] \
        [--ballast-mb M] \
        [--timeout S] [--release FIFO] \
        [--host ADDR] [--salvage] [--device cpu|cuda] [--rank R --ranks K --store-port P]

With ``--ranks K`` (K > 1) the process is rank R of a group of K ranks, each its own process,
that meet through the store at ``--host``:``--store-port`` (the test hosts it): rank 0's Manager
runs the group's manager server, the others reach it through the store. Rank R reduces with rank
R of every other group and heals from one, as a shard of a sharded model would; the ranks of a
group do not reduce with each other (each trains the whole small model: rank R of the job is a
one-rank job of its own, in step with the other ranks through the group's quorum and vote).

It trains the small MLP of ``tests/integration/workers.py`` under fault-tolerant DDP at
``min_replica_size=1``, on the batches of that module (a function of group and step), with SGD
and momentum (the momentum buffers are optimizer state a healing group must receive). Every
manager name used exists in torchheal and in the reference (torchft), so ``--impl torchft`` runs
the same job on the reference's Manager.

Where a marker below says the worker holds "until a line arrives", the line is read from the
FIFO ``--release`` names (opened at start-up, read and write, so that neither end ever waits for
the other to open it), else from stdin: a worker the tests start warm has no stdin of its own
(``tests/warm.py``).

It prints one ``@ff {json}`` line per event on stdout (flushed, so the lines a process wrote
before a SIGKILL are still read):

* ``ready``: the Manager is constructed.
* ``reduce``: the DDP comm hook is about to reduce step ``step`` in quorum ``quorum_id``;
  ``participating`` (False: this group heals and sends zeros) and ``divisor`` (what the sum is
  divided by). A test replays the job's history from these lines.
* ``reducing``: (``--hold-after N``) the group is inside its comm hook, in the step after its
  N-th full commit, and will not contribute until a line arrives; the test freezes
  it there, while the other groups wait in the collective for its data.
* ``dying``: (``--die-after N``) in the step after its N-th full commit, the group started the
  allreduce and SIGKILLs itself now, from inside backward.
* ``dying``: (``--die-before-reducing N``) the same, but before its allreduce starts: none of
  its data reaches the others, so their collective of that step cannot complete.
* ``dying``: (``--die-at-join``, torchheal only) the group's first quorum with every group of
  the job in it was just answered; the group SIGKILLs itself now, before it builds the process
  group for that quorum, while the other groups build theirs and wait for its address.
* ``reduced``: (``--hold-reduced N``) in the step after its N-th full commit, the group's
  allreduce completed (with every group's data) and the group holds in its comm hook, before
  its vote, until a line arrives. With ``--fail-reduce N`` (torchheal only) that
  allreduce completes but reports a failure (``FakeProcessGroupWrapper``), as a collective does
  whose peer reset the connection just after the last byte.
* ``receiving``: (``--hold-in-heal``, torchheal only) the group's first heal has received its
  first MiB of the source's state and stops reading, inside the HTTP transport's receive, until
  a line arrives; the test freezes it there, its source's send part way through.
  ``--ballast-mb M`` adds M MiB to every group's state (a tensor the heal carries and nothing
  trains), so that a stream outgrows the socket buffers.
* ``build-failing``: (``--fail-build-at-join``, torchheal only) the group's first quorum with
  every group of the job in it was just answered; its build of the process group for that
  quorum raises before it publishes the group's address, as a build whose connection to the
  rendezvous store was cut does. The other groups building it wait for that address. The group
  goes on as usual: its step fails, and it asks for the next quorum.
* ``stopping``: (``--stop-at-rejoin``, torchheal only) a quorum of every group was just answered
  after one of fewer (a lost group is back); the group SIGSTOPs itself now, before it builds the
  process group for that quorum. The test SIGCONTs it.
* ``heal-failing``: (``--fail-heal``, torchheal only) the first heal of this process fails: its
  receive of the source's state raises a connection reset before it reads a byte (the source's
  host went away, say). With ``--ranks K`` the other ranks of the group heal as usual.
* ``step``: one iteration ended: ``before``/``after`` step, ``committed`` (what the vote
  decided: a heal moves the step counter before its step is voted on), and the ``reduce``
  record of the attempt (None when the step failed before reducing).
* ``done``: the group stopped (see below); its final weights are in ``--out``.

With ``FAILFAST_TRACE=1`` in its environment (opt-in; off by default), a group also appends one
record per iteration to ``OUT.trace`` (``trace.append_record``): the ``step`` event's fields with
its parameters, their gradients (as reduced) and the momentum buffers after the optimizer's step,
so ``tests/failfast/trace.py`` can find the first step where a group left the replayed history.

Stopping: once the test writes a target step into ``--target-file`` (atomically), a group stops
at the first step >= target whose commit was *full* (all ``--groups`` groups contributed and the
divisor was the group count). Every group sees the same full commit, so all stop at the same step
with the same weights; a group that lagged behind (left out of a round, healing) keeps going with
the others until such a commit. Injected failures apply to the first incarnation only.

The injected failures count *full commits* otherwise: the commits of a step whose divisor was the
group count (a quorum of every group), whether or not this group contributed. A group that healed
in such a step (its first quorum with the others, at ``init_sync``) counts it as the others do,
so that every group's N-th full commit is the same step: groups that start together and make
their first quorum at once would otherwise fail, hold or die one step apart.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import importlib
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.integration.workers import batch, make_model

PREFIX = "@ff "
LR = 0.05
MOMENTUM = 0.9


def seed_of(group: int, incarnation: int) -> int:
    """The seed of a group's initial weights (every incarnation starts from different ones)."""
    return 1 + 10 * group + incarnation


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer every group (and the test's replay) uses."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def emit(kind: str, **fields: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n")
    sys.stdout.flush()


def read_target(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except FileNotFoundError:
        return None


def on_timeline(handler: logging.Handler) -> None:
    """Hands ``handler`` every mark of ``torchheal.checkpointing.timeline`` (``quorum.end``)."""
    timeline = logging.getLogger("torchheal.timeline")
    timeline.setLevel(logging.DEBUG)
    timeline.propagate = False
    timeline.addHandler(handler)


def die_at_join(group: int, groups: int) -> None:
    """SIGKILLs this process once it is answered a new quorum of all ``groups`` groups.

    The quorum thread marks ``quorum.end`` (``torchheal.checkpointing.timeline``) right after
    the answer and before the process group is built for it: dying there leaves the others
    building a group for a quorum this one will never join.
    """

    class Die(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            fields = getattr(record, "fields", {})
            if (
                getattr(record, "phase", None) == "quorum.end"
                and fields.get("replicas") == groups
                and fields.get("quorum_id") != fields.get("current")
            ):
                emit("dying", group=group, quorum_id=fields["quorum_id"])
                os.kill(os.getpid(), signal.SIGKILL)

    on_timeline(Die())


def stop_at_rejoin(group: int, groups: int) -> None:
    """SIGSTOPs this process once it is answered a quorum of all ``groups`` groups after one
    of fewer that followed a full one: a lost group came back, and this one freezes before it
    builds the process group for that quorum (the others build theirs on the store of the
    quorum's first up-to-date group, which this one may be). Like ``die_at_join``, on
    ``quorum.end``."""
    full = shrunk = False  # (the groups' start, before the first full quorum, is no loss)

    class Stop(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            nonlocal full, shrunk
            fields = getattr(record, "fields", {})
            if getattr(record, "phase", None) != "quorum.end":
                return
            if fields.get("replicas") != groups:
                shrunk = full
            elif not shrunk:
                full = True
            elif fields.get("quorum_id") != fields.get("current"):
                full = shrunk = False
                emit("stopping", group=group, quorum_id=fields["quorum_id"])
                os.kill(os.getpid(), signal.SIGSTOP)

    on_timeline(Stop())


def fail_build_at_join(group: int, groups: int, pg: Any) -> None:
    """The build for the first quorum of all ``groups`` groups raises before it starts.

    Armed on ``quorum.end`` (as ``die_at_join``), on the quorum thread just before it builds
    the process group for that quorum; the wrapped ``configure`` is the one the build calls.
    """
    armed = done = False
    configure = pg.configure

    class Arm(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            nonlocal armed
            fields = getattr(record, "fields", {})
            if (
                not done
                and getattr(record, "phase", None) == "quorum.end"
                and fields.get("replicas") == groups
                and fields.get("quorum_id") != fields.get("current")
            ):
                armed = True

    @functools.wraps(configure)  # its signature: the Manager passes the quorum's keywords
    def failing(*a: Any, **k: Any) -> Any:
        nonlocal armed, done
        if armed:
            armed, done = False, True
            emit("build-failing", group=group, quorum_id=k.get("quorum_id"))
            raise ConnectionResetError("injected: the rendezvous store's connection was cut")
        return configure(*a, **k)

    pg.configure = failing
    on_timeline(Arm())


def hold_in_heal(group: int) -> None:
    """The first heal's receive stops reading after its first MiB until a line arrives.

    It wraps the HTTP transport's reads of the data (``read_segments``'s ``readinto``): the real
    client, held part way through the stream.
    """
    from torchheal.checkpointing import _http_fetch

    real = _http_fetch.read_segments
    held = False

    def read_segments(readinto: Any, *a: Any, **k: Any) -> Any:
        got = 0

        def holding(view: Any) -> int:
            nonlocal got, held
            n = readinto(view)
            got += n
            if not held and got >= 1 << 20:
                held = True
                emit("receiving", group=group, nbytes=got)
                sys.stdin.readline()  # the test freezes us here, then lets us go on
            return n

        return real(holding, *a, **k)

    _http_fetch.read_segments = read_segments


def fail_heal(group: int) -> None:
    """The first heal's receive raises a connection reset before it reads (see ``hold_in_heal``
    for where)."""
    from torchheal.checkpointing import _http_fetch

    real = _http_fetch.read_segments
    failed = False

    def read_segments(*a: Any, **k: Any) -> Any:
        nonlocal failed
        if not failed:
            failed = True
            emit("heal-failing", group=group)
            raise ConnectionResetError("injected: the source's connection was reset")
        return real(*a, **k)

    _http_fetch.read_segments = read_segments


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["torchheal", "torchft"], default="torchheal")
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--groups", type=int, required=True, help="the job's group count")
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--target-file", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=10.0, help="collectives and should_commit")
    p.add_argument("--hold-after", type=int, default=-1, help="full commits, then hold once")
    p.add_argument("--die-after", type=int, default=-1, help="full commits, then die")
    p.add_argument(
        "--die-before-reducing", type=int, default=-1, help="full commits, then die unreduced"
    )
    p.add_argument("--die-at-join", action="store_true", help="die before the first full build")
    p.add_argument("--fail-reduce", type=int, default=-1, help="full commits, then fail a reduce")
    p.add_argument("--hold-reduced", type=int, default=-1, help="full commits, then hold reduced")
    p.add_argument("--hold-in-heal", action="store_true", help="hold part way into a heal")
    p.add_argument("--fail-heal", action="store_true", help="the first heal's receive fails")
    p.add_argument("--stop-at-rejoin", action="store_true", help="SIGSTOP when a group rejoins")
    p.add_argument(
        "--fail-build-at-join", action="store_true", help="the first full build fails at once"
    )
    p.add_argument("--ballast-mb", type=int, default=0, help="MiB of untrained state")
    p.add_argument("--host", default="127.0.0.1", help="address of this group's store")
    p.add_argument("--salvage", action="store_true", help="Manager(salvage_step=True)")
    p.add_argument("--device", default="cpu", help="where the model trains (Gloo either way)")
    p.add_argument("--rank", type=int, default=0, help="this process's rank in its group")
    p.add_argument("--ranks", type=int, default=1, help="the group's rank count")
    p.add_argument("--store-port", type=int, default=0, help="the group's store (--ranks > 1)")
    p.add_argument("--release", help="a FIFO the test writes a line to where we hold")
    args = p.parse_args()
    # The harness asks for every thread's stack when a wait times out (Job.wait_for).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.release:
        sys.stdin = open(os.open(args.release, os.O_RDWR), encoding="utf-8")
    if args.ranks > 1 and not args.store_port:
        p.error("--ranks > 1 needs --store-port: the group's ranks meet in that store")
    first = args.incarnation == 0

    torch.set_num_threads(1)
    ft = importlib.import_module(args.impl)
    device = torch.device(args.device)
    model = make_model(seed_of(args.group, args.incarnation)).to(device)
    inner = make_optimizer(model)
    timeout = timedelta(seconds=args.timeout)
    if args.ranks == 1:
        store = dist.TCPStore(args.host, 0, is_master=True, wait_for_workers=False)
        store_port = store.port
    else:
        store_port = args.store_port
    extra = {"salvage_step": True} if args.salvage else {}
    pg = ft.ProcessGroupGloo(timeout=timeout)
    if args.fail_reduce >= 0:
        from torchheal.process_group.wrappers import FakeProcessGroupWrapper

        pg = FakeProcessGroupWrapper(pg)
    ballast = torch.zeros((args.ballast_mb << 20) // 4)

    def state_dict() -> dict[str, Any]:
        state = {"model": model.state_dict(), "optim": inner.state_dict()}
        return {**state, "ballast": ballast} if args.ballast_mb else state

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])
        if args.ballast_mb:
            ballast.copy_(sd["ballast"])  # (a no-op when it was received in place)

    if first and args.hold_in_heal:
        hold_in_heal(args.group)
    if args.fail_heal:
        fail_heal(args.group)
    manager = ft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
        rank=args.rank,
        world_size=args.ranks,
        store_addr=args.host,
        store_port=store_port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"g{args.group}",
        **extra,
    )
    emit("ready", group=args.group, inc=args.incarnation, pid=os.getpid())
    if first and args.die_at_join:
        die_at_join(args.group, args.groups)
    if args.stop_at_rejoin:
        stop_at_rejoin(args.group, args.groups)
    if first and args.fail_build_at_join:
        fail_build_at_join(args.group, args.groups, pg)

    attempt: dict[str, Any] = {}
    full_commits = 0
    held = failed = False
    reduce = manager.allreduce

    def allreduce(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        # DDP's comm hook calls manager.allreduce: this instance attribute sees every bucket.
        nonlocal held, failed
        record = None
        # A salvaged step redoes its allreduces in a new quorum: its first one is recorded
        # again (the new quorum and divisor are the ones the commit used).
        # (A reference Manager has no salvage.)
        salvage = getattr(manager, "_salvage", None)
        replay = salvage is not None and salvage.replaying and not attempt.get("replayed")
        if replay:
            attempt["replayed"] = True
        if not manager.errored() and ("reduce" not in attempt or replay):
            manager.wait_quorum()
            record = {
                "step": manager.current_step(),
                "quorum_id": manager._quorum_id,
                "participating": bool(manager.is_participating()),
                "divisor": manager.num_participants(),
                "batch_step": attempt["batch_step"],
                "salvaged": replay,
            }
            attempt["reduce"] = record
            emit("reduce", group=args.group, inc=args.incarnation, **record)
            if first and not held and 0 <= args.hold_after <= full_commits:
                held = True
                emit("reducing", group=args.group, **record)
                sys.stdin.readline()  # the test freezes us here, then lets us go on
        if first and record is not None and 0 <= args.die_before_reducing <= full_commits:
            emit("dying", group=args.group, **record)
            os.kill(os.getpid(), signal.SIGKILL)
        if first and record is not None and 0 <= args.fail_reduce <= full_commits and not failed:
            failed = True
            pg.report_future_error(RuntimeError("injected: the peer reset after the last byte"))
        work = reduce(tensor, *a, **k)
        if first and record is not None and 0 <= args.hold_reduced <= full_commits and not held:
            held = True
            work.wait()  # with every group's data; an injected failure is reported here
            emit("reduced", group=args.group, errored=manager.errored() is not None, **record)
            sys.stdin.readline()  # the test kills a group meanwhile, then lets us go on
        if first and record is not None and 0 <= args.die_after <= full_commits:
            emit("dying", group=args.group, **record)
            os.kill(os.getpid(), signal.SIGKILL)
        return work

    manager.allreduce = allreduce
    # What the step's vote decided. Not the step counter's move: a heal loads the source's step
    # before the heal step is voted on, so a heal step that fails still moves the counter.
    decisions: list[bool] = []
    vote = manager.should_commit

    def should_commit(*a: Any, **k: Any) -> bool:
        decision = vote(*a, **k)
        decisions.append(decision)
        return decision

    manager.should_commit = should_commit
    ddp = ft.DistributedDataParallel(manager, model)
    optimizer = ft.Optimizer(manager, inner)

    trace = open(args.out + ".trace", "ab") if os.environ.get("FAILFAST_TRACE") == "1" else None
    target: int | None = None
    last_full = False
    while True:
        step = manager.current_step()
        if target is None:
            target = read_target(args.target_file)
            if target is not None and step >= target:
                emit("error", group=args.group, message=f"target {target} already passed: {step}")
                sys.exit(3)
        if target is not None and step >= target and last_full:
            break
        attempt.clear()
        decisions.clear()
        optimizer.zero_grad()
        # A healing group's step may still move (the quorum runs in the background), but it
        # sends zeros; a contributing group is at the step it computes.
        attempt["batch_step"] = manager.current_step()
        x, y = (t.to(device) for t in batch(args.group, 0, attempt["batch_step"]))
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        after = manager.current_step()
        record = attempt.get("reduce")
        committed = bool(decisions) and decisions[-1]
        last_full = (
            committed
            and record is not None
            and record["participating"]
            and record["divisor"] == args.groups
        )
        full_commits += committed and record is not None and record["divisor"] == args.groups
        fields = {"before": step, "after": after, "committed": committed, "reduce": record}
        emit("step", group=args.group, inc=args.incarnation, **fields)
        if trace is not None:
            from tests.failfast.trace import append_record  # (it imports this module)

            append_record(trace, fields, model, inner)
    torch.save({k: v.cpu().clone() for k, v in model.state_dict().items()}, args.out)
    emit("done", group=args.group, inc=args.incarnation, step=manager.current_step())
    manager.shutdown()


if __name__ == "__main__":
    main()
