"""PGTransport over real gloo process groups (3 ranks as threads in this process)."""

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.checkpointing.test_serialization import assert_same, sample_state
from torchheal.checkpointing import CheckpointError, CheckpointTimeoutError
from torchheal.checkpointing.pg_transport import PGTransport

TIMEOUT = timedelta(seconds=20)


def gloo_groups(world_size: int) -> list[Any]:
    """Real gloo groups on a loopback TCPStore bound to port 0, one client per rank."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    groups: list[Any] = [None] * world_size

    def make(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=TIMEOUT)
        groups[rank] = dist.ProcessGroupGloo(
            dist.PrefixStore("pgt", client), rank, world_size, TIMEOUT
        )

    run_ranks([lambda r=r: make(r) for r in range(world_size)])
    groups.append(store)  # keep the store alive with the groups
    return groups


def run_ranks(fns: list[Callable[[], Any]]) -> list[Any]:
    """Runs one function per rank in threads; re-raises the first failure."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "rank thread hung"
    if errors:
        raise errors[0]
    return results


def test_multi_rank_recovery_in_place_and_timeout() -> None:
    pgs = gloo_groups(3)
    state1 = sample_state()
    state2 = {"w": torch.randn(1000, 7), "step": 2, "name": "two"}
    template = {"model": {"weight": torch.zeros(33, 17)}, "views": {"full": torch.zeros(6, 8)}}
    weight_storage = template["model"]["weight"].untyped_storage().data_ptr()

    def rank0() -> None:
        t = PGTransport(pgs[0], TIMEOUT, "cpu", block_bytes=4096)
        assert t.metadata() == "<n/a>"
        t.send_checkpoint([1, 2], 1, state1, TIMEOUT)
        t.send_checkpoint([2], 2, state2, TIMEOUT)
        # Rank 2 asks for 5: refused after the description (no tensors, so nothing is left
        # unmatched on the pair; after a real refusal the manager reconfigures the PG).
        t.send_checkpoint([2], 4, {"step": 4})

    def rank1() -> Any:
        t: PGTransport = PGTransport(pgs[1], TIMEOUT, "cpu", state_dict=lambda: template)
        return t.recv_checkpoint(0, "<n/a>", 1, TIMEOUT)

    def rank2() -> tuple[Any, Any]:
        t: PGTransport = PGTransport(pgs[2], TIMEOUT, torch.device("cpu"))
        one = t.recv_checkpoint(0, "<n/a>", 1, TIMEOUT)
        two = t.recv_checkpoint(0, "<n/a>", 2, TIMEOUT)
        with pytest.raises(CheckpointError, match="wanted step 5"):
            t.recv_checkpoint(0, "<n/a>", 5, TIMEOUT)
        return one, two

    _, got1, (got2_1, got2_2) = run_ranks([rank0, rank1, rank2])
    assert_same(state1, got1)
    assert_same(state1, got2_1)
    assert_same(state2, got2_2)
    # In place: the template's tensors were filled, and are the objects returned.
    assert got1["model"]["weight"] is template["model"]["weight"]
    assert got1["model"]["weight"].untyped_storage().data_ptr() == weight_storage
    assert torch.equal(template["views"]["full"], state1["views"]["full"])

    # Nobody sends step 3: a short timeout fails promptly with a timeout error.
    t = PGTransport(pgs[1], timedelta(milliseconds=10), "cpu")
    with pytest.raises(CheckpointTimeoutError, match=r"timed out|timeout"):
        t.recv_checkpoint(0, "<n/a>", 3, timedelta(milliseconds=10))


def test_unsendable_state_fails_before_anything_is_sent() -> None:
    class FakePG:  # the failure happens while encoding, before any PG call
        def send(self, *a: Any) -> Any:
            raise AssertionError("nothing may be sent")

    with pytest.raises(CheckpointError, match="object"):
        PGTransport(FakePG(), TIMEOUT, "cpu").send_checkpoint([1], 1, {"x": object()}, TIMEOUT)


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class _MemoryPG:
    """In-memory twin of a 2-rank PG: sends are queued by tag, receives copy them out."""

    def __init__(self, mailbox: dict[int, list[torch.Tensor]], damage_tag: int | None) -> None:
        self._mailbox, self._damage_tag = mailbox, damage_tag

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Done:
        data = tensors[0].clone()
        if tag == self._damage_tag:
            data.view(torch.uint8)[0] ^= 1  # (the packed tail is padding)
        self._mailbox.setdefault(tag, []).append(data)
        return _Done()

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Done:
        tensors[0].copy_(self._mailbox[tag].pop(0))
        return _Done()


@pytest.mark.parametrize(("damage_tag", "storage"), [(3, "storage [0-9]"), (4, "storage 0")])
def test_corruption_in_packed_or_large_message_detected(damage_tag: int, storage: str) -> None:
    # Storage 0 is large (own message, tag 4); storages 1.. are small (packed, tag 3).
    state = {"big": torch.randn(300_000), "small": [torch.randn(5) for _ in range(20)]}
    mailbox: dict[int, list[torch.Tensor]] = {}
    clean = _MemoryPG(mailbox, None)
    PGTransport(clean, TIMEOUT, "cpu").send_checkpoint([1], 1, state)
    assert_same(state, PGTransport(clean, TIMEOUT, "cpu").recv_checkpoint(0, "<n/a>", 1))
    bad = _MemoryPG(mailbox, damage_tag)
    PGTransport(bad, TIMEOUT, "cpu").send_checkpoint([1], 1, state)
    with pytest.raises(CheckpointError, match=f"checksum mismatch in {storage}"):
        PGTransport(bad, TIMEOUT, "cpu").recv_checkpoint(0, "<n/a>", 1)


@pytest.mark.gpu
def test_gpu_state_travels_through_a_cpu_transport() -> None:
    # The Manager hands the transport its live state: on a GPU job, CUDA tensors. Gloo carries
    # them through CPU buffers; what arrives is the same values, on the CPU (as the reference).
    pgs = gloo_groups(2)
    state = {
        "w": torch.randn(1000, 7, device="cuda"),
        "h": torch.randn(5, dtype=torch.bfloat16, device="cuda"),
        "cpu": torch.arange(6),
        "step": 3,
    }

    def rank0() -> None:
        PGTransport(pgs[0], TIMEOUT, "cpu", block_bytes=4096).send_checkpoint([1], 3, state)

    def rank1() -> Any:
        return PGTransport(pgs[1], TIMEOUT, "cpu").recv_checkpoint(0, "<n/a>", 3, TIMEOUT)

    _, got = run_ranks([rank0, rank1])
    assert got["step"] == 3
    for key in ("w", "h", "cpu"):
        assert got[key].device.type == "cpu" and got[key].dtype == state[key].dtype, key
        assert torch.equal(got[key], state[key].cpu()), key
