"""Fuzz every network endpoint of torchheal and print what each did with its inputs.

Endpoints: every RPC of the lighthouse (``Quorum``, ``Heartbeat``, torchheal's ``Session``
stream) and of the manager server (``Quorum``, ``CheckpointMetadata``, ``ShouldCommit``,
``Kill``, the last against a server in a child process that a well-formed ``Kill`` ends by
design, and torchheal's ``Watch`` stream), every HTTP endpoint (checkpoint
server, lighthouse dashboard, parameter server), and the checkpoint receivers fed hostile
streams end to end (HTTP from a hostile server process, PG from a hostile sender process into a
live template, the in-memory decoder into a template).

Each endpoint first gets its known hostile inputs, then ``--inputs`` generated ones (hypothesis,
derandomized: every run of the same source tree sends the same inputs; hypothesis also
draws constants it finds in torchheal's modules, so editing torchheal can change them). Columns: inputs sent; rejected with a clear
error (a gRPC status with a message, an HTTP 4xx with a body, ``CheckpointError``); accepted
(well-formed and answered normally, or a valid checkpoint loaded); unclear (an error that names
nothing or comes from an unexpected exception, a dropped connection, a receiver disagreeing
with the decoder), state changed (refused, yet the server's state or a template moved),
crashes (the server thread or process died, or stopped answering a normal request); then
whether a normal request succeeded afterwards. The last three columns must be 0 and "ok"; the
exit status says whether they are. The tables of refusal messages show what the refusals said.

    .venv/bin/python bench/fuzz.py                    # 10,000 generated inputs per endpoint
    .venv/bin/python bench/fuzz.py --inputs 500 --only "lighthouse Quorum" "manager Kill"

A PG receiver input needs a fresh two-process Gloo group (~0.2 s), so that endpoint gets
``--pg-inputs`` (default 2,000) instead. Timings depend on the machine and its load.

Then slow clients (``tests/fuzz/slow_clients.py``) against every listener, each in a fresh
process, with the job token set: ``--slow`` connections (half send a request that never
completes, half nothing). Its table shows the server's RSS before and while they are held, a
normal request made meanwhile, and how many connections the server closed at once, later
(within ``--slow-watch`` seconds), or never. A failed normal request fails the run.

    .venv/bin/python bench/fuzz.py --slow-only        # the slow clients alone (a few minutes)
    .venv/bin/python bench/fuzz.py --slow-only --slow 400 --only "lighthouse direct TCP lane"
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import multiprocessing
import os
import pickle
import sys
import time
from pathlib import Path

# gRPC logs every malformed header it refuses; the table counts them instead.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz import grpc_targets, http_targets, receiver_targets, slow_clients, stream_targets
from tests.fuzz.runner import BAD, Tally, fuzz, table

PG = receiver_targets.PgReceiverTarget.name


def targets() -> dict[str, object]:
    """Every endpoint's constructor, in table order."""
    return {
        **grpc_targets.all_targets(),
        **stream_targets.all_targets(),
        **http_targets.all_targets(),
        **receiver_targets.all_targets(),
    }


def run_one(name: str, n: int) -> Tally:
    """Fuzz one endpoint (in a worker process); returns its tally."""
    logging.basicConfig(level=logging.CRITICAL)
    logging.getLogger().setLevel(logging.CRITICAL)
    target = targets()[name]()  # type: ignore[operator]
    try:
        tally = fuzz(target, n, probe_every=500)
    finally:
        target.close()
    # The tally goes back to the parent by pickle: an input that cannot go is left out.
    tally.bad_values = [v for v in tally.bad_values if _picklable(v)]
    return tally


def run_slow(name: str, n: int, watch_s: float) -> slow_clients.SlowResult:
    """Slow clients against one listener (in a fresh worker process: the RSS is its own)."""
    logging.basicConfig(level=logging.CRITICAL)
    logging.getLogger().setLevel(logging.CRITICAL)
    return slow_clients.run_listener(name, n, watch_s)


def slow(n: int, watch_s: float, jobs: int, names: list[str]) -> bool:
    """Run and print the slow-client table; returns whether every normal request was served."""
    start = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=ctx, max_tasks_per_child=1
    ) as pool:
        results = list(pool.map(run_slow, names, [n] * len(names), [watch_s] * len(names)))
    print()
    print(slow_clients.table(results))
    print(f"\nslow clients: {time.monotonic() - start:.0f} s")
    failed = [r.name for r in results if r.normal is not None]
    if failed:
        print(f"\nFAILED (normal request while held): {failed}")
    return not failed


def _picklable(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=10_000, help="generated inputs per endpoint")
    parser.add_argument("--pg-inputs", type=int, default=2_000, help="for the PG receiver")
    parser.add_argument("--only", nargs="*", help="endpoint names (default: all)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument(
        "--save-bad",
        type=Path,
        help="write each endpoint's first bad inputs, whole, to DIR/<endpoint>.pickle "
        "(a list of (Outcome, input); read it with pickle to replay them)",
    )
    parser.add_argument("--slow", type=int, default=100, help="slow clients per listener (0: none)")
    parser.add_argument("--slow-watch", type=float, default=90.0, help="seconds to watch them")
    parser.add_argument("--slow-only", action="store_true", help="only the slow clients")
    args = parser.parse_args()
    if args.slow_only:
        listeners = args.only or list(slow_clients.LISTENERS)
        unknown = set(listeners) - set(slow_clients.LISTENERS)
        if unknown:
            parser.error(
                f"unknown listeners {sorted(unknown)}; known: {list(slow_clients.LISTENERS)}"
            )
        return 0 if slow(args.slow, args.slow_watch, args.jobs, listeners) else 1
    names = args.only or list(targets())
    unknown = set(names) - set(targets())
    if unknown:
        parser.error(f"unknown endpoints {sorted(unknown)}; known: {list(targets())}")
    start = time.monotonic()
    tallies: dict[str, Tally] = {}
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        jobs = {
            pool.submit(run_one, name, args.pg_inputs if name == PG else args.inputs): name
            for name in names
        }
        for job in concurrent.futures.as_completed(jobs):
            tally = job.result()
            tallies[jobs[job]] = tally
            print(
                f"[{time.monotonic() - start:6.0f}s] {tally.name}: {dict(tally.counts)}, "
                f"normal request after: {tally.normal_after or 'ok'}",
                flush=True,
            )
    ordered = [tallies[name] for name in names]
    print()
    print(table(ordered))
    print(f"\n{sum(t.inputs for t in ordered)} inputs in {time.monotonic() - start:.0f} s")
    for tally in ordered:
        print(f"\n{tally.name}: most frequent answers")
        for detail, count in tally.details.most_common(8):
            print(f"  {count:6d}  {detail}")
        for bad in tally.bad:
            print(f"  BAD: {bad}")
    if args.save_bad is not None:
        args.save_bad.mkdir(parents=True, exist_ok=True)
        for tally in ordered:
            if tally.bad_values:
                path = args.save_bad / f"{tally.name.replace(' ', '_').replace('/', '_')}.pickle"
                path.write_bytes(pickle.dumps(tally.bad_values))
                print(f"{len(tally.bad_values)} bad inputs of {tally.name} in {path}")
    failed = [t.name for t in ordered if not t.ok or any(t.counts[k] for k in BAD)]
    if failed:
        print(f"\nFAILED: {failed}")
    served = (
        slow(args.slow, args.slow_watch, args.jobs, list(slow_clients.LISTENERS))
        if args.slow
        else True
    )
    return 1 if failed or not served else 0


if __name__ == "__main__":
    sys.exit(main())
