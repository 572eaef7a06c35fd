"""A healer receives straight into its own tensors (``into=``), and says so when that failed
part way: those tensors then hold a mix of old and unverified bytes."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from torchheal.checkpointing import CheckpointError, HTTPTransport, TornCheckpointError
from torchheal.checkpointing.deserialization import allocate_buffers, parse_description
from torchheal.checkpointing.serialization import stage

TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def pair() -> Iterator[tuple[HTTPTransport, HTTPTransport]]:
    src = HTTPTransport(TIMEOUT, 0, hostname="localhost", block_bytes=1 << 16)
    dst = HTTPTransport(TIMEOUT, 0, hostname="localhost")
    yield src, dst
    src.shutdown()
    dst.shutdown()


def _source_state() -> dict[str, object]:
    torch.manual_seed(1)
    return {
        "model": {"w": torch.randn(512, 1024), "b": torch.randn(512)},
        "optim": {"exp_avg": torch.randn(512, 1024)},  # the healer has none yet
        "step": 7,
    }


def test_matching_tensors_are_received_into_and_returned_as_themselves(
    pair: tuple[HTTPTransport, HTTPTransport],
) -> None:
    src, dst = pair
    state = _source_state()
    mine = {"model": {"w": torch.zeros(512, 1024), "b": torch.zeros(512)}, "optim": {}}
    src.send_checkpoint([1], 3, state, TIMEOUT)
    out = dst.recv_checkpoint(0, src.metadata(), 3, TIMEOUT, into=mine)
    assert out["model"]["w"] is mine["model"]["w"] and out["model"]["b"] is mine["model"]["b"]
    assert torch.equal(mine["model"]["w"], state["model"]["w"])  # written where it lies
    assert torch.equal(mine["model"]["b"], state["model"]["b"])
    assert torch.equal(out["optim"]["exp_avg"], state["optim"]["exp_avg"])  # fresh memory
    assert out["step"] == 7


def test_a_mismatched_tensor_is_not_received_into() -> None:
    state = _source_state()
    desc = parse_description(stage(state, 1).description)
    wrong_dtype = {"model": {"w": torch.zeros(512, 1024, dtype=torch.float64)}}
    wrong_size = {"model": {"w": torch.zeros(512, 1000)}}
    for template in (wrong_dtype, wrong_size):
        _, used = allocate_buffers(desc, template)
        assert not used


def test_one_storage_of_the_healer_is_never_the_target_of_two() -> None:
    # The source keeps "a" and "b" apart; the healer ties them (one storage): receiving both
    # into it would let the second overwrite the first.
    state = {"a": torch.randn(1000), "b": torch.randn(1000)}
    desc = parse_description(stage(state, 1).description)
    tied = torch.zeros(1000)
    buffers, used = allocate_buffers(desc, {"a": tied, "b": tied})
    assert len(used) == 1
    assert buffers[0].data_ptr() != buffers[1].data_ptr()


def test_a_receive_that_fails_part_way_says_the_tensors_are_torn(
    pair: tuple[HTTPTransport, HTTPTransport],
) -> None:
    src, dst = pair
    mine = {"model": {"w": torch.zeros(512, 1024), "b": torch.zeros(512)}}
    # A source that sends the real description and half the data, then hangs up.
    src.send_checkpoint([1], 3, _source_state(), TIMEOUT)
    whole = _download(src, 3)
    url = _truncating_server(whole, len(whole) // 2)
    with pytest.raises(TornCheckpointError, match="mix of old and unverified"):
        dst.recv_checkpoint(0, url, 3, TIMEOUT, into=mine)
    # Without a template the same failure is an ordinary one (nothing of the healer's touched).
    url = _truncating_server(whole, len(whole) // 2)
    with pytest.raises(CheckpointError) as caught:
        dst.recv_checkpoint(0, url, 3, TIMEOUT)
    assert not isinstance(caught.value, TornCheckpointError)


def _download(src: HTTPTransport, step: int) -> bytes:
    with socket.create_connection(("localhost", src._server.server_port), timeout=10) as s:
        s.sendall(f"GET /checkpoint/{step}/full HTTP/1.0\r\n\r\n".encode())
        chunks = []
        while data := s.recv(1 << 20):
            chunks.append(data)
    raw = b"".join(chunks)
    return raw[raw.index(b"\r\n\r\n") + 4 :]


def _truncating_server(body: bytes, cut: int) -> str:
    listener = socket.create_server(("localhost", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                conn.sendall(head + body[:cut])

    threading.Thread(target=serve, daemon=True).start()
    return f"http://localhost:{port}/checkpoint/"
