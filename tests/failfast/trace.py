"""Per-step traces of the fail-fast worker, and where a trace first leaves the replayed history.

A debugging aid, opt-in (``FAILFAST_TRACE=1``): the worker appends one record per iteration to
``OUT.trace``; :func:`first_divergence` replays the committed history step by step (as
``replay.replay`` does) and compares every committed record of every group with it, the reduced
gradient first (what the collective produced) and then the weights and momentum (what the step
made of it), so a bad step is named with the quantity that went wrong first.

    python -m tests.failfast.trace EVENTS.json RUN_DIR
"""

from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from tests.failfast.replay import CommittedStep, _one_thread, history
from tests.failfast.worker import make_optimizer, seed_of
from tests.integration.workers import batch, make_model


def append_record(
    out: BinaryIO, fields: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Appends one iteration's record (``fields`` and the model's state after it) to ``out``."""
    params = list(model.parameters())
    record = {
        **fields,
        "params": [p.detach().clone() for p in params],
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
        "momentum": [optimizer.state.get(p, {}).get("momentum_buffer") for p in params],
    }
    pickle.dump(record, out)
    out.flush()


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of one trace file (a truncated last record, from a SIGKILL, is left out)."""
    records = []
    with open(path, "rb") as f:
        while True:
            try:
                records.append(pickle.load(f))
            except (EOFError, pickle.UnpicklingError):
                return records


def _gap(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            if (x is None) != (y is None):
                return float("inf")
            continue
        worst = max(worst, (x - y).abs().max().item())
    return worst


def expected_states(steps: list[CommittedStep]) -> dict[int, dict[str, list]]:
    """For each committed step: the reduced gradient, and the params and momentum after it."""
    ((group, incarnation),) = steps[0].contributors
    out = {}
    with _one_thread():
        model = make_model(seed_of(group, incarnation))
        optimizer = make_optimizer(model)
        params = list(model.parameters())
        for s in steps:
            total = None
            for g, _ in s.contributors:
                model.zero_grad()
                x, y = batch(g, 0, s.step)
                nn.functional.mse_loss(model(x), y).backward()
                grads = [p.grad.detach().clone() for p in params]
                total = (
                    grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
                )
            assert total is not None
            for p, t in zip(params, total, strict=True):
                p.grad = t.div_(s.divisor)
            optimizer.step()
            out[s.step] = {
                "grads": [p.grad.clone() for p in params],
                "params": [p.detach().clone() for p in params],
                "momentum": [optimizer.state[p]["momentum_buffer"].clone() for p in params],
            }
    return out


def first_divergence(
    events: list[dict], traces: dict[str, list[dict]], tolerance: float = 1e-5
) -> list[str]:
    """Lines describing, per trace, each committed record whose state leaves the replay.

    Args:
        events: the job's events.
        traces: trace name -> its records.
        tolerance: the largest absolute gap counted as equal.
    """
    steps = history(events)
    expected = expected_states(steps)
    by_step = {s.step: s for s in steps}
    lines = []
    for name, records in sorted(traces.items()):
        bad = 0
        for r in records:
            if not r["committed"]:
                continue
            step = r["after"] - 1
            if step not in expected:
                continue
            gaps = {k: _gap(r[k], expected[step][k]) for k in ("grads", "params", "momentum")}
            if max(gaps.values()) > tolerance:
                bad += 1
                if bad <= 5:
                    lines.append(
                        f"{name} step {step} {by_step[step]} reduce={r['reduce']} "
                        + " ".join(f"{k}={v:.3e}" for k, v in gaps.items())
                    )
        lines.append(f"{name}: {len(records)} records, {bad} off the replay")
    return lines


def main() -> None:
    import json

    events = json.loads(Path(sys.argv[1]).read_text())
    run = Path(sys.argv[2])

    # Rank r of every group is a history of its own (groups of several ranks: ``job.py``); a
    # trace of rank r > 0 is named ``g{G}i{I}r{r}.pt.trace``.
    def rank_of(path: Path) -> int:
        match = re.fullmatch(r"g\d+i\d+(?:r(\d+))?\.pt\.trace", path.name)
        return int(match.group(1) or 0) if match else -1

    for rank in sorted({e.get("rank", 0) for e in events}):
        mine = [e for e in events if e.get("rank", 0) == rank]
        traces = {
            p.name: read_records(p) for p in sorted(run.glob("*.trace")) if rank_of(p) == rank
        }
        for line in first_divergence(mine, traces):
            print(line)


if __name__ == "__main__":
    main()
