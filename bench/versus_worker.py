"""One rank of ``bench/versus.py``: the same model, data and optimizer under each way of training.

``--mode ddp`` runs under torchrun (one rank of stock DDP over Gloo) and saves a
``torch.distributed.checkpoint`` every ``--save-every`` steps, resuming from the newest complete
one when torchrun restarts it; ``--mode ft`` is one replica group (1 rank) of torchheal or the
reference (``--impl``), restarted on its own by the driver (``bench.goodput.Job``).

Model: an MLP (512-1024-1024-256, ~1.8M parameters, ~21 MB of state with AdamW's moments),
batch 32 per rank, one torch thread: small, so that three ranks leave most of two cores idle and
a dead rank does not speed the others up (the step is mostly ``--compute-s``). Data is a function of (rank, step) only, and the targets come from a fixed small
teacher network plus noise, so the loss falls and every way that reaches step N has seen the same
batches (a checkpoint-and-restart job replays them exactly; a fault-tolerant job misses the
batches of a group that was out). The final loss is measured on a fixed held-out set.
Events are goodput's lines (``@goodput {...}``), so its ``Job`` reads them.
"""

from __future__ import annotations

import time

T_EXEC = time.time()  # before the imports: interpreter start-up is part of a restart

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

PREFIX = "@goodput "  # bench.goodput.PREFIX: its Job parses these lines
BATCH, D_IN, D_OUT = 32, 512, 256


def emit(kind: str, **fields: object) -> None:
    sys.stdout.write(PREFIX + json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


def build(lr: float):
    """The model, its AdamW and the teacher, all from fixed seeds."""
    import torch
    from torch import nn

    torch.set_num_threads(1)  # three ranks share the cores
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(D_IN, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, D_OUT)
    )
    torch.manual_seed(1)
    teacher = nn.Sequential(nn.Linear(D_IN, 64), nn.Tanh(), nn.Linear(64, D_OUT))
    teacher.requires_grad_(False)
    return model, torch.optim.AdamW(model.parameters(), lr=lr), teacher


def batch(teacher, rank: int, step: int, n: int = BATCH):
    """Rank ``rank``'s batch of step ``step`` (``rank`` -1: the held-out set)."""
    import torch

    g = torch.Generator().manual_seed((rank + 2) * 1_000_003 + step)
    x = torch.randn(n, D_IN, generator=g)
    return x, teacher(x) + 0.1 * torch.randn(n, D_OUT, generator=g)


def eval_loss(model, teacher) -> float:
    import torch
    from torch import nn

    with torch.no_grad():
        x, y = batch(teacher, -1, 0, 512)
        return float(nn.functional.mse_loss(model(x), y))


def noise_mark(steps: int) -> int:
    """The step whose held-out loss, beside step N's, says how much 5% of the steps move it."""
    return int(0.95 * steps)


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under ``root`` (DCP writes ``.metadata`` last)."""
    done = [
        (int(p.name.split("_")[1]), p) for p in root.glob("step_*") if (p / ".metadata").exists()
    ]
    return max(done) if done else None


def run_ddp(args: argparse.Namespace) -> None:
    """One torchrun rank: stock DDP, a DCP save every ``--save-every`` steps, resume on restart."""
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    emit("exec", t=T_EXEC, group=rank, inc=restart, pid=os.getpid())
    model, optim, teacher = build(args.lr)
    # The agent's store outlives a restart: keys of the ranks that died would be read as the new
    # ranks' addresses (Gloo then connects to a dead port), so each restart has its own prefix.
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"versus/{restart}", agent), rank=rank, world_size=world
    )
    ddp = nn.parallel.DistributedDataParallel(model)
    root = Path(args.ckpt_dir)
    step, load_s = 0, 0.0
    found = latest_checkpoint(root)
    if found is not None:
        t = time.time()
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(found[1]))
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        step, load_s = found[0], time.time() - t
    emit("ready", group=rank, inc=restart, step=step, load_s=load_s, pid=os.getpid())
    while step < args.steps:
        optim.zero_grad()
        x, y = batch(teacher, rank, step)
        out = ddp(x)
        if args.compute_s:
            time.sleep(args.compute_s)  # an accelerator's share of the step: no CPU used
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        optim.step()
        step += 1
        emit(
            "step",
            group=rank,
            inc=restart,
            before=step - 1,
            after=step,
            committed=True,
            participants=dist.get_world_size(),
            loss=loss.item(),
        )
        if step == noise_mark(args.steps):
            emit("eval", group=rank, inc=restart, step=step, eval_loss=eval_loss(model, teacher))
        if args.save_every and step % args.save_every == 0 and step < args.steps:
            t = time.time()
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"step_{step}"))
            dist.barrier()  # every rank's part is written before the save counts
            emit("saved", group=rank, inc=restart, step=step, save_s=time.time() - t)
            if rank == 0:  # keep the newest two: the newest may be torn by a kill
                for _, path in sorted((int(p.name.split("_")[1]), p) for p in root.glob("step_*"))[
                    :-2
                ]:
                    shutil.rmtree(path, ignore_errors=True)
    emit("done", group=rank, inc=restart, step=step, eval_loss=eval_loss(model, teacher))
    dist.destroy_process_group()


def run_ft(args: argparse.Namespace) -> None:
    """One replica group of torchheal or the reference, until the job has committed ``--steps``."""
    emit("exec", t=T_EXEC, warm=os.environ.get("TORCHHEAL_WARM_SPARE") == "1")
    from datetime import timedelta

    import torch.distributed as dist
    from torch import nn

    ft = importlib.import_module(args.impl)
    model, inner, teacher = build(args.lr)
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    emit("built")
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=timeout),
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"versus_{args.group}",
    )
    emit("ready")
    ddp = ft.DistributedDataParallel(manager, model)
    optimizer = ft.Optimizer(manager, inner)
    stop = Path(args.stop_file)
    while manager.current_step() < args.steps and not stop.exists():
        before = manager.current_step()
        optimizer.zero_grad()
        x, y = batch(teacher, args.group, before)
        out = ddp(x)
        if args.compute_s:
            time.sleep(args.compute_s)
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        optimizer.step()
        after = manager.current_step()
        emit(
            "step",
            before=before,
            after=after,
            committed=after > before,
            participants=manager.num_participants(),
            loss=loss.item(),
        )
        if after > before and after == noise_mark(args.steps):
            emit("eval", step=after, eval_loss=eval_loss(model, teacher))
    if manager.current_step() >= args.steps:
        emit("done", step=manager.current_step(), eval_loss=eval_loss(model, teacher))
    manager.shutdown(wait=False)
    os._exit(0)  # skip the interpreter's slow teardown (gloo and grpc threads)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("ddp", "ft"), required=True)
    p.add_argument("--impl", default="torchheal", help="ft: torchheal or torchft")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--compute-s", type=float, default=0.0)
    p.add_argument("--save-every", type=int, default=0, help="ddp: DCP save every K steps")
    p.add_argument("--ckpt-dir", default="", help="ddp: where the checkpoints go")
    p.add_argument("--group", type=int, default=0, help="ft: the replica group")
    p.add_argument("--lighthouse", default="", help="ft: the lighthouse's address")
    p.add_argument("--stop-file", default="", help="ft: stop when it exists")
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    run_ddp(args) if args.mode == "ddp" else run_ft(args)


if __name__ == "__main__":
    main()
