"""Semi-synchronous training with (Streaming) DiLoCo and torchheal: the script a user copies.

Each replica group trains on its own for ``SYNC_EVERY`` inner steps (AdamW), then the groups
average their pseudo-gradients (global weights minus local weights) and apply them with an
outer Nesterov SGD (lr 0.7). Communication across groups happens once per window instead of
every step. With ``USE_STREAMING=True`` the model is split into fragments that sync in turn,
each fragment's allreduce overlapping ``FRAGMENT_SYNC_DELAY`` inner steps of compute.

Locally, two replica groups with a lighthouse, restarts and optional failure injection:

    torchheal launch --replicas 2 -- python examples/train_diloco.py
    torchheal launch --replicas 2 --kill-every 60s -- python examples/train_diloco.py

Or one torchrun job per replica group against a lighthouse:

    torchheal lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000

    REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 TORCHHEAL_LIGHTHOUSE=http://localhost:29510 \
        torchrun --master_port=29600 --nnodes=1 --nproc_per_node=1 -- examples/train_diloco.py

    REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 TORCHHEAL_LIGHTHOUSE=http://localhost:29510 \
        torchrun --master_port=29601 --nnodes=1 --nproc_per_node=1 -- examples/train_diloco.py

Environment: ``STEPS`` (outer steps = fragment syncs to train, default 1000), ``SYNC_EVERY``
(inner steps per full sync, default 20), ``USE_STREAMING`` (``True``/``False``, default
``True``), ``N_FRAGMENTS`` (default 2 when streaming), ``FRAGMENT_SYNC_DELAY`` (default 1),
``FRAGMENT_UPDATE_ALPHA`` (default 0.0). Runs on CPU with Gloo by default and on CUDA with
NCCL when a GPU is present. The data is synthetic, so nothing is downloaded.

A group that dies and comes back heals at its next sync from a healthy peer: model, inner
optimizer, every fragment's global weights and outer-optimizer state, and the step.

Data follows the data plan (docs/data.md): inner step ``j`` of outer step ``s`` reads the
``GLOBAL_BATCH`` samples of data step ``s * (SYNC_EVERY // N_FRAGMENTS) + j`` (default 16 per
group), split over the groups of the last sync; ``WindowGuard`` fails a sync whose quorum is not
the one the window was read with, so the window is read again by the new quorum, and no
sample of a committed window is lost or read twice.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed import TCPStore

from torchheal import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchheal.checkpointing.pg_transport import PGTransport
from torchheal.data import DataPlan, StepLoader, WindowGuard
from torchheal.local_sgd import DiLoCo

logging.basicConfig(level=logging.WARNING)

STEPS = int(os.environ.get("STEPS", "1000"))
SYNC_EVERY = int(os.environ.get("SYNC_EVERY", "20"))
USE_STREAMING = os.environ.get("USE_STREAMING", "True") == "True"
N_FRAGMENTS = int(os.environ.get("N_FRAGMENTS", "2" if USE_STREAMING else "1"))
FRAGMENT_SYNC_DELAY = int(os.environ.get("FRAGMENT_SYNC_DELAY", "1" if USE_STREAMING else "0"))
FRAGMENT_UPDATE_ALPHA = float(os.environ.get("FRAGMENT_UPDATE_ALPHA", "0.0"))

VOCAB, DIM, SEQ, BATCH, BLOCKS = 128, 64, 32, 16, 4


class Block(nn.Module):
    """A residual MLP block (a stand-in for a transformer layer; enough to show DiLoCo)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def build_model() -> nn.Sequential:
    """Embedding, blocks, head: a tiny next-token model."""
    return nn.Sequential(
        nn.Embedding(VOCAB, DIM),
        *[Block(DIM) for _ in range(BLOCKS)],
        nn.LayerNorm(DIM),
        nn.Linear(DIM, VOCAB),
    )


def split_fragments(model: nn.Sequential, n: int) -> list[nn.Module]:
    """Cut the model's layers into ``n`` contiguous fragments; every parameter is in one."""
    layers = list(model)
    bounds = [round(i * len(layers) / n) for i in range(n + 1)]
    return [nn.ModuleList(layers[bounds[i] : bounds[i + 1]]) for i in range(n)]


class SyntheticSequences(torch.utils.data.Dataset):
    """Token sequences following ``x[t+1] = (5 x[t] + 3) mod VOCAB`` with 10% noise.

    Sequence ``i`` is drawn from a generator seeded with ``i``: inputs and next-token targets.
    """

    def __init__(self, size: int = 1_000_000) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        tokens = torch.empty(SEQ + 1, dtype=torch.long)
        tokens[0] = int(torch.randint(0, VOCAB, (1,), generator=g))
        for t in range(SEQ):
            tokens[t + 1] = (5 * tokens[t] + 3) % VOCAB
        noise = torch.rand(tokens.shape, generator=g) < 0.1
        tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=g), tokens)
        return tokens[:-1], tokens[1:]


def store_from_env() -> tuple[str, int, TCPStore | None]:
    """torchrun's store (MASTER_ADDR/PORT), or a private one when run without torchrun."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
    # Under `torchheal launch` each replica group is one process: it hosts its own store.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    return "127.0.0.1", store.port, store


def main() -> None:
    replica_group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    num_replica_groups = int(os.environ.get("NUM_REPLICA_GROUPS", "2"))
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store_addr, store_port, _store = store_from_env()

    # The same initial weights everywhere, and no init_sync: a heal at the first sync would
    # replace the healers' first window by the primary's (their samples of it lost).
    torch.manual_seed(0)
    model = build_model().to(device)
    inner_optimizer = torch.optim.AdamW(
        model.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95)
    )
    fragments = split_fragments(model, N_FRAGMENTS)
    outer_optimizers = [
        torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments
    ]

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner_optim": inner_optimizer.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner_optimizer.load_state_dict(sd["inner_optim"])

    timeout = timedelta(seconds=30)
    pg = (
        ProcessGroupNCCL(timeout=timeout)
        if device.type == "cuda"
        else ProcessGroupGloo(timeout=timeout)
    )
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_diloco_{replica_group}",
        store_addr=store_addr,
        store_port=store_port,
        # DiLoCo needs a synchronous quorum: a healing group loads the global state before
        # it computes pseudo-gradients.
        use_async_quorum=False,
        init_sync=False,
        timeout=timeout,
        # A quorum waits for peers still inside their window (and for restarts): keep it long.
        quorum_timeout=timedelta(minutes=10),
        # PGTransport sends the state over the replica groups' own process group, inside the
        # (synchronous) quorum; the default HTTPTransport works too.
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=device),
    )

    # Each inner step reads GLOBAL_BATCH samples over the groups (BATCH each when all are in);
    # a window of SYNC_EVERY // N_FRAGMENTS inner steps is read with the last sync's quorum.
    dataset = SyntheticSequences()
    plan = DataPlan(
        dataset_size=len(dataset),
        batch_size=int(os.environ.get("GLOBAL_BATCH", str(BATCH * num_replica_groups))),
        inner_steps=SYNC_EVERY // N_FRAGMENTS,
        seed=0,
    )
    loader = StepLoader(dataset, plan, manager, initial=(num_replica_groups, replica_group))
    criterion = nn.CrossEntropyLoss(reduction="sum")
    inner_step = 0
    participants = 0
    with DiLoCo(
        WindowGuard(manager, loader),  # a sync whose quorum the window did not expect fails
        fragments,
        inner_optimizer,
        outer_optimizers,
        sync_every=SYNC_EVERY,
        fragment_sync_delay=FRAGMENT_SYNC_DELAY,
        fragment_update_alpha=FRAGMENT_UPDATE_ALPHA,
    ):
        while manager.current_step() < STEPS:
            batch = loader.next_step()
            inner_optimizer.zero_grad()
            total = 0.0
            for inputs, targets in batch:
                logits = model(inputs.to(device))
                # A sample's loss is its mean token loss; the plan scales the sum of them.
                loss = criterion(logits.reshape(-1, VOCAB), targets.to(device).reshape(-1)) / SEQ
                (loss * batch.loss_scale).backward()
                total += loss.item()
            loss = torch.tensor(total / max(1, len(batch.indices)))
            step_before = manager.current_step()
            inner_optimizer.step()  # every SYNC_EVERY / N_FRAGMENTS steps: a fragment syncs
            inner_step += 1
            if manager.current_step() != step_before:
                participants = manager.num_participants()
                print(
                    f"[group {replica_group}/{num_replica_groups}] outer step "
                    f"{manager.current_step()} inner step {inner_step} loss {loss.item():.4f} "
                    f"participants {participants}",
                    flush=True,
                )
    print(
        f"[group {replica_group}] finished at outer step {manager.current_step()} "
        f"after {inner_step} inner steps (last sync: {participants} groups)",
        flush=True,
    )
    manager.shutdown()
    pg.shutdown()


if __name__ == "__main__":
    main()
