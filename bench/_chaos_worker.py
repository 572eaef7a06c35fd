"""One rank of one replica group of the chaos soak (``bench/chaos.py``).

Started torchrun-like by ``torchheal.launcher.group.GroupStart`` (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` of the group's store, ``TORCHHEAL_LIGHTHOUSE``,
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHELASTIC_RESTART_COUNT``). Each rank holds
its own shard: a tiny MLP seeded by (group, rank, start), so a restarted group really must heal;
rank ``r`` of every group forms the cross-replica process group of shard ``r``. The group
commits a step only when both its ranks vote to.

It prints one ``@chaos {json}`` line per event (flushed, so what a SIGKILLed rank wrote is read):

* ``step``: ``before``/``after``, ``committed``, and what the step was reduced in
  (``quorum_id``, ``participating``, ``divisor``; None when it failed before reducing);
* ``done``: stopped at ``step``; the final weights are in ``--out-dir``;
* ``flip``: with ``--flip-dir``, a bit flipped on the soak's order (below);
* ``divergence``: the divergence guard logged a mismatch (``step``: the compared step, and its
  ``message``, which names the keys and tensors that differ).

``step`` events carry the guard's counters too (``guard``: ``checks``, ``mismatches``,
``verified``: the last step compared and found equal).

Bit flips (``bench/_chaos_flips.py``): with ``--flip-dir D`` the rank looks for
``D/flip-g{group}r{rank}.json`` after every step, and applies it right after a commit in a full
quorum (its state is then the job's, so only the flip makes it differ): it XORs one bit of one
element of one parameter, removes the file and emits ``flip`` with the order's ``id``.

Stopping: once ``--target-file`` holds a step, the rank stops at the first step at or past it
whose commit was full (every group contributed): every rank of every group sees the same one.
``--compute-s`` sleeps in every step, standing for accelerator time, so six ranks on two cores
are not CPU-bound.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn

PREFIX = "@chaos "
IN, HIDDEN, OUT = 8, 16, 4


_emitting = threading.Lock()  # the guard's reports are logged from other threads too


def emit(kind: str, **fields: Any) -> None:
    line = PREFIX + json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n"
    with _emitting:
        sys.stdout.write(line)
        sys.stdout.flush()


class GuardReports(logging.Handler):
    """Emits the guard's mismatch reports (its ERROR line, not the step failure quoting it)."""

    REPORT = re.compile(r"\] divergence at step (\d+): ")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        found = self.REPORT.search(message)
        if record.levelno >= logging.ERROR and found:
            emit("divergence", step=int(found.group(1)), message=message[:2000])


def flip_ordered(path: str, model: nn.Module, step: int) -> None:
    """Applies the flip ordered in ``path``, if any, removes the order and emits ``flip``."""
    try:
        with open(path) as f:
            order = json.load(f)  # written whole, then renamed into place
    except FileNotFoundError:
        return
    values = model.get_parameter(order["tensor"]).detach().view(-1)
    before = values[order["element"]].item()
    values.view(torch.int32)[order["element"]] ^= 1 << order["bit"]
    os.unlink(path)
    emit("flip", id=order["id"], step=step, before=before, after=values[order["element"]].item())


def batch(group: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1_000_003 * group + 10_007 * rank + step)
    return torch.randn(16, IN, generator=gen), torch.randn(16, OUT, generator=gen)


def read_target(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target-file", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--timeout", type=float, default=30.0, help="collectives and commit votes")
    p.add_argument("--compute-s", type=float, default=0.0)
    p.add_argument("--flip-dir", default="", help="where the soak orders bit flips")
    args = p.parse_args()

    import torchheal as ft

    # LOGLEVEL (the soak passes INFO): the manager's and its server's lines, time-stamped, go to
    # stderr, which the soak keeps per rank (g{group}i{start}r{rank}.log).
    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "WARNING"),
        format="%(created).3f %(levelname).1s %(name)s %(message)s",
    )
    logging.getLogger("torchheal").addHandler(GuardReports())
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    group = int(os.environ["REPLICA_GROUP_ID"])
    groups = int(os.environ["NUM_REPLICA_GROUPS"])
    start = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(1 + 10 * rank + 100 * group + 1000 * start)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    timeout = timedelta(seconds=args.timeout)
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30),
        replica_id=f"chaos{group}",
    )
    attempt: dict[str, Any] = {}
    # The quorum the lighthouse answered this step with, as the quorum thread takes it in (the
    # connected id below can differ: a rebuild that failed, or a member-lost abort).
    answered: dict[str, Any] = {}
    take_outcome = manager._quorums._apply

    def apply(outcome: Any) -> None:
        q = outcome.quorum
        answered.update(
            quorum_id=q.quorum_id,
            members=list(q.replica_ids),
            max_step=q.max_step,
            heal=bool(q.heal),
            count=outcome.participation.count,
        )
        take_outcome(outcome)

    manager._quorums._apply = apply
    reduce = manager.allreduce

    def allreduce(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        # DDP's comm hook calls manager.allreduce: record the quorum of the step's reduction.
        if not manager.errored() and "reduce" not in attempt:
            manager.wait_quorum()
            attempt["reduce"] = {
                "quorum_id": manager._quorum_id,
                "participating": bool(manager.is_participating()),
                "divisor": manager.num_participants(),
            }
        return reduce(tensor, *a, **k)

    manager.allreduce = allreduce
    # What the step's vote decided. Not the step counter's move: a heal loads the source's step
    # before its heal step is voted on, so a heal step that fails (a vote overruled after a
    # stall, say) still moves the counter.
    decisions: list[bool] = []
    vote = manager.should_commit

    def should_commit(*a: Any, **k: Any) -> bool:
        decision = vote(*a, **k)
        decisions.append(decision)
        return decision

    manager.should_commit = should_commit
    ddp = ft.DistributedDataParallel(manager, model)
    optimizer = ft.Optimizer(manager, inner)

    flips = args.flip_dir and os.path.join(args.flip_dir, f"flip-g{group}r{rank}.json")
    target: int | None = None
    last_full = False
    while True:
        step = manager.current_step()
        if target is None:
            target = read_target(args.target_file)
            if target is not None and step >= target:
                emit("error", message=f"target {target} already passed: {step}")
                sys.exit(3)
        if target is not None and step >= target and last_full:
            break
        attempt.clear()
        answered.clear()
        decisions.clear()
        optimizer.zero_grad()
        x, y = batch(group, rank, manager.current_step())
        nn.functional.mse_loss(ddp(x), y).backward()
        if args.compute_s:
            time.sleep(args.compute_s)
        optimizer.step()
        after = manager.current_step()
        record = attempt.get("reduce")
        committed = bool(decisions) and decisions[-1]
        last_full = bool(
            committed and record and record["participating"] and record["divisor"] == groups
        )
        stats = manager._telemetry.stats
        emit(
            "step",
            before=step,
            after=after,
            committed=committed,
            reduce=record,
            answered=dict(answered) or None,
            guard={
                "checks": stats.divergence_checks,
                "mismatches": stats.divergence_mismatches,
                "verified": stats.last_verified_step,
            },
        )
        if flips and last_full:
            flip_ordered(flips, model, after)
    out = os.path.join(args.out_dir, f"g{group}r{rank}.pt")
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out)
    emit("done", step=manager.current_step())
    manager.shutdown()


if __name__ == "__main__":
    main()
