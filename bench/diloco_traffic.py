"""Cross-replica traffic and step time of DiLoCo vs DDP, measured on two live replica groups.

Two replica groups (one process each, Gloo on loopback, a real lighthouse and Managers) train a
~5M-parameter MLP (batch 32, AdamW inner). For every configuration each group first runs the
same number of purely local inner steps (no manager, no communication) as the baseline, then
the configuration itself; the first window (quorum set-up and the init_sync heal) is excluded.

Traffic is measured two ways, per group and per inner step:

* ``PG bytes``: the bytes of every tensor handed to a collective of the process group the
  Manager uses (a counting wrapper around ProcessGroupGloo), i.e. the data-plane payload;
* ``wire bytes``: what the process actually wrote to its sockets (``wchar`` of
  ``/proc/self/io``), which adds the control plane (quorum and commit RPCs, heartbeats).

Time columns: ``local ms`` is a separate purely local run (same process, just before);
``between`` the mean of the run's steps that neither started a quorum nor synced, i.e. local
training between syncs measured in the same run; ``step ms`` the mean over all measured steps,
syncs included; ``overhead`` is ``step / between - 1`` (``step / local - 1`` for DDP, where every
step syncs). On a shared machine, compare ``step`` with ``between``: separate runs drift.

Goal: traffic divided by ``sync_every`` (4x less again with quantization) while a DiLoCo inner
step costs within 5% of a local-only step.

    python -m bench.diloco_traffic [--windows 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

IN, HIDDEN, OUT, BATCH = 512, 1152, 512, 32


@dataclass(frozen=True)
class Config:
    """One benchmark row."""

    name: str
    algorithm: str  # "ddp" or "diloco"
    sync_every: int = 1
    quantize: bool = False
    n_fragments: int = 1
    delay: int = 0


CONFIGS = [
    Config("DDP (every step)", "ddp"),
    Config("DiLoCo sync_every=10", "diloco", sync_every=10),
    Config("DiLoCo sync_every=50", "diloco", sync_every=50),
    Config("DiLoCo sync_every=50 quantized", "diloco", sync_every=50, quantize=True),
    Config("Streaming DiLoCo 50, 2 frag, delay 2", "diloco", sync_every=50, n_fragments=2, delay=2),
]


def build_model() -> nn.Sequential:
    """512 -> 4 x 1152 -> 512 MLP: 5.2M parameters."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, OUT),
    )


def _written_bytes() -> int:
    """Bytes this process wrote through write(2)-family calls, sockets included."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar")


def _counting_pg(timeout: timedelta) -> Any:
    """ProcessGroupGloo inside a wrapper that adds up the bytes handed to its collectives."""
    from torchheal.process_group import ProcessGroupGloo, ProcessGroupWrapper

    class CountingProcessGroup(ProcessGroupWrapper):
        def __init__(self) -> None:
            super().__init__(pg=ProcessGroupGloo(timeout=timeout))
            self.bytes = 0

        def _count(self, tensors: Any) -> None:
            if isinstance(tensors, torch.Tensor):
                self.bytes += tensors.numel() * tensors.element_size()
            else:
                for t in tensors:
                    self._count(t)

        def allreduce(self, tensors, opts):  # type: ignore[override]
            self._count(tensors)
            return super().allreduce(tensors, opts)

        def allgather(self, output_tensors, input_tensor, opts):  # type: ignore[override]
            self._count(input_tensor)
            return super().allgather(output_tensors, input_tensor, opts)

        def alltoall_base(self, output, input, output_splits, input_splits, opts):  # type: ignore[override]
            self._count(input)
            return super().alltoall_base(output, input, output_splits, input_splits, opts)

        def broadcast(self, tensor_list, opts):  # type: ignore[override]
            self._count(tensor_list)
            return super().broadcast(tensor_list, opts)

        def send(self, tensors, dst_rank, tag):  # type: ignore[override]
            self._count(tensors)
            return super().send(tensors, dst_rank, tag)

    return CountingProcessGroup()


def _batch(group: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * group + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def _local_only(group: int, steps: int) -> float:
    """Seconds per inner step of plain local training (the baseline)."""
    model = build_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):  # warm-up (allocator, AdamW state)
        inner.zero_grad()
        x, y = _batch(group, 0)
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
    t0 = time.perf_counter()
    for step in range(steps):
        inner.zero_grad()
        x, y = _batch(group, step)
        nn.functional.mse_loss(model(x), y).backward()
        inner.step()
    return (time.perf_counter() - t0) / steps


def worker(cfg: Config, group: int, lighthouse: str, windows: int, out: Any) -> None:
    """One replica group: local-only baseline, then ``cfg``; puts its measurements on ``out``."""
    torch.set_num_threads(1)  # two groups share two cores
    from torch.distributed import TCPStore

    from torchheal import DistributedDataParallel, Manager, Optimizer
    from torchheal.checkpointing.pg_transport import PGTransport
    from torchheal.local_sgd import DiLoCo

    measured_steps = windows * cfg.sync_every if cfg.algorithm == "diloco" else 40
    local_s = _local_only(group, measured_steps)

    timeout = timedelta(seconds=60)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = _counting_pg(timeout)
    model = build_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    manager = Manager(
        pg=pg,
        load_state_dict=lambda sd: (model.load_state_dict(sd["m"]), inner.load_state_dict(sd["o"])),
        state_dict=lambda: {"m": model.state_dict(), "o": inner.state_dict()},
        min_replica_size=2,
        use_async_quorum=cfg.algorithm == "ddp",
        timeout=timeout,
        quorum_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"bench{group}",
        # PGTransport keeps healing traffic on the counted process group; the heal happens in
        # the excluded first window either way.
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
    )
    if cfg.algorithm == "ddp":
        forward: Any = DistributedDataParallel(manager, model)
        optimizer: Any = Optimizer(manager, inner)
        algo: Any = None
        warmup = 2
    else:
        layers = list(model)
        if cfg.n_fragments == 1:
            fragments: list[nn.Module] = [model]
        else:
            half = len(layers) // 2 + 1
            fragments = [nn.Sequential(*layers[:half]), nn.Sequential(*layers[half:])]
        outer = [
            torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments
        ]
        algo = DiLoCo(
            manager,
            fragments,
            inner,
            outer,
            sync_every=cfg.sync_every,
            should_quantize=cfg.quantize,
            fragment_sync_delay=cfg.delay,
        )
        algo.__enter__()
        forward, optimizer = model, inner
        warmup = cfg.sync_every  # the first full window: quorum set-up and init_sync heal

    def step(i: int) -> None:
        optimizer.zero_grad()
        x, y = _batch(group, i)
        nn.functional.mse_loss(forward(x), y).backward()
        optimizer.step()

    for i in range(warmup):
        step(i)
    pg_bytes0, wire0 = pg.bytes, _written_bytes()
    durations, local_durations = [], []
    for i in range(measured_steps):
        quorum, committed = manager._quorum_future, manager.current_step()
        t = time.perf_counter()
        step(warmup + i)
        durations.append(time.perf_counter() - t)
        if manager._quorum_future is quorum and manager.current_step() == committed:
            local_durations.append(durations[-1])  # no quorum, no sync: a local step
    # Steps without a sync, timed in the same run: the local-only cost between syncs, free of
    # the drift between two separate runs on a shared machine.
    between = local_durations or durations
    result = {
        "group": group,
        "local_s": local_s,
        "between_s": sum(between) / len(between),
        "step_s": sum(durations) / measured_steps,
        "pg_bytes": (pg.bytes - pg_bytes0) / measured_steps,
        "wire_bytes": (_written_bytes() - wire0) / measured_steps,
        "manager_steps": manager.current_step(),
    }
    if algo is not None:
        algo.__exit__(None, None, None)
    manager.shutdown()
    pg.shutdown()
    out.put(result)


def run_config(cfg: Config, windows: int) -> list[dict[str, Any]]:
    """Both groups of one configuration; returns their measurements."""
    from torchheal.coordination import LighthouseServer

    ctx = mp.get_context("spawn")
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100, quorum_tick_ms=10
    )
    addr = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    out = ctx.Queue()
    procs = [
        ctx.Process(target=worker, args=(cfg, g, addr, windows, out), daemon=True) for g in range(2)
    ]
    try:
        for p in procs:
            p.start()
        results: list[dict[str, Any]] = []
        deadline = time.monotonic() + 900
        while len(results) < len(procs):
            try:
                results.append(out.get(timeout=1.0))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{cfg.name}: workers failed ({dead}) or timed out"
                    ) from None
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0, f"{cfg.name}: worker exited with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    return sorted(results, key=lambda r: r["group"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=3, help="sync windows measured")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    params = sum(p.numel() for p in build_model().parameters())
    print(f"model: {params / 1e6:.2f}M parameters ({params * 4 / 2**20:.1f} MiB fp32), 2 groups")
    rows = []
    for cfg in CONFIGS:
        res = run_config(cfg, args.windows)
        mean = {
            k: sum(r[k] for r in res) / len(res)
            for k in ("local_s", "between_s", "step_s", "pg_bytes", "wire_bytes")
        }
        rows.append((cfg, mean))
    # The reduction is taken on wire bytes: a quantized allreduce hands the PG an all-to-all
    # plus an allgather, so its PG payload overstates what actually crosses the sockets.
    ddp_wire = rows[0][1]["wire_bytes"]
    header = (
        f"{'configuration':40} {'PG MB/step':>10} {'wire MB/step':>12} {'vs DDP':>8} "
        f"{'local ms':>9} {'between':>8} {'step ms':>8} {'overhead':>9}"
    )
    print(header)
    print("-" * len(header))
    for cfg, m in rows:
        print(
            f"{cfg.name:40} {m['pg_bytes'] / 1e6:10.3f} {m['wire_bytes'] / 1e6:12.3f} "
            f"{ddp_wire / m['wire_bytes'] if m['wire_bytes'] else float('inf'):7.1f}x "
            f"{m['local_s'] * 1e3:9.1f} {m['between_s'] * 1e3:8.1f} {m['step_s'] * 1e3:8.1f} "
            f"{(m['step_s'] / (m['between_s'] if cfg.algorithm == 'diloco' else m['local_s']) - 1) * 100:8.1f}%"
        )


if __name__ == "__main__":
    main()
