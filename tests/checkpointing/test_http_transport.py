"""HTTPTransport over loopback: round trips, lock states, errors, tokens, hostile peers."""

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch

from tests.checkpointing.test_serialization import assert_same, sample_state
from torchheal.checkpointing import CheckpointError, CheckpointTimeoutError, HTTPTransport
from torchheal.checkpointing.deserialization import decode_bytes
from torchheal.checkpointing.live import LIVE_FROM_BYTES
from torchheal.checkpointing.serialization import encode_bytes

TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def make() -> Iterator[Callable[..., HTTPTransport]]:
    made: list[HTTPTransport] = []

    def factory(num_chunks: int = 0, timeout: timedelta = TIMEOUT, **kw: object) -> HTTPTransport:
        t: HTTPTransport = HTTPTransport(timeout, num_chunks, hostname="localhost", **kw)
        made.append(t)
        return t

    yield factory
    for t in made:
        t.shutdown()


@pytest.mark.parametrize("num_chunks", [0, 3])
def test_round_trip(make: Callable[..., HTTPTransport], num_chunks: int) -> None:
    src, dst = make(num_chunks, block_bytes=4096), make(num_chunks)
    state = sample_state()
    state["big"] = torch.randn(20000)  # several blocks, split across chunks
    src.send_checkpoint([1], 5, state, TIMEOUT)
    assert src.metadata() == src.address()
    assert src.metadata().startswith("http://localhost:") and src.metadata().endswith(
        "/checkpoint/"
    )
    out = dst.recv_checkpoint(0, src.metadata(), 5, TIMEOUT)
    assert_same(state, out)
    # Served again to a second healer while allowed.
    assert_same(state, dst.recv_checkpoint(0, src.metadata(), 5, TIMEOUT))


def test_starts_disallowed_and_allow_disallow_idempotent(
    make: Callable[..., HTTPTransport],
) -> None:
    t = make(timeout=timedelta(seconds=0.2))
    assert t._step == -1 and t._live is None
    t.disallow_checkpoint()
    t.disallow_checkpoint()
    assert t._live is None
    # Nothing served yet: a request waits at most the short wait, then fails (never forever).
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="503"):
        make().recv_checkpoint(0, t.metadata(), 3, TIMEOUT)
    assert time.monotonic() - started < 5
    state = {"x": torch.ones(2 << 20)}  # 8 MB: served live
    t.send_checkpoint([1], 3, state, TIMEOUT)
    t.allow_checkpoint(3)
    t.allow_checkpoint(3)
    assert t._live is not None and t._step == 3
    t.disallow_checkpoint()
    t.disallow_checkpoint()
    # Disallowed: the state may change, and the healer still gets it as it was sent.
    state["x"].fill_(-1.0)
    assert torch.equal(
        make().recv_checkpoint(0, t.metadata(), 3, TIMEOUT)["x"], torch.ones(2 << 20)
    )


def test_step_mismatch_400(make: Callable[..., HTTPTransport]) -> None:
    src = make()
    src.send_checkpoint([1], 2345, {"x": torch.ones(1)}, TIMEOUT)
    with pytest.raises(CheckpointError, match=r"400.*serving 2345 but got step=1234"):
        make().recv_checkpoint(0, src.metadata(), 1234, TIMEOUT)


def test_bad_url_400(make: Callable[..., HTTPTransport]) -> None:
    src = make()
    src.allow_checkpoint(1)
    port = src._server.server_port
    # int() would take "+1", " 1" and "1_0": refused, not read as a step.
    for path in (
        "/foo/1/full",
        "/checkpoint/1",
        "/checkpoint/x/full",
        "/checkpoint/+1/full",
        "/checkpoint/1_0/full",
        "/checkpoint/%201/full",
        "/checkpoint/-1/full",
    ):
        conn = http.client.HTTPConnection("localhost", port, timeout=5)
        conn.request("GET", path)
        resp = conn.getresponse()
        assert resp.status == 400
        assert b"invalid url format, expected /checkpoint/step/key but got" in resp.read()
        conn.close()


def test_a_newer_step_no_send_is_coming_for_is_refused_without_waiting_the_timeout(
    make: Callable[..., HTTPTransport],
) -> None:
    # The transport's timeout is a minute; the client gives up after 20 s: a request held
    # for the whole timeout (a hostile or confused client tying up a handler) fails here.
    src = make(timeout=timedelta(seconds=60))
    src.send_checkpoint([1], 5, {"x": torch.ones(1)}, TIMEOUT)
    port = src._server.server_port
    for path in ("/checkpoint/6/full", "/checkpoint/" + "9" * 30 + "/full"):
        conn = http.client.HTTPConnection("localhost", port, timeout=20)
        conn.request("GET", path)
        resp = conn.getresponse()
        assert resp.status == 400, path
        assert b"serving 5 but got step=" in resp.read()
        conn.close()


def test_a_request_that_comes_before_its_send_begins_is_served_once_staged(
    make: Callable[..., HTTPTransport],
) -> None:
    src, dst = make(), make()
    src.send_checkpoint([1], 5, {"x": torch.ones(1)}, TIMEOUT)
    got: dict[str, object] = {}

    def healer() -> None:
        try:
            got["state"] = dst.recv_checkpoint(0, src.metadata(), 6, TIMEOUT)
        except Exception as e:
            got["error"] = e

    asking = threading.Thread(target=healer)
    asking.start()
    src.send_checkpoint([1], 6, {"x": torch.full((1,), 6.0)}, TIMEOUT)  # before or after it asks
    asking.join(30)
    assert "error" not in got, got
    assert torch.equal(got["state"]["x"], torch.full((1,), 6.0))  # type: ignore[index]


def test_timeout_on_silent_server(make: Callable[..., HTTPTransport]) -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/checkpoint/"
        started = time.monotonic()
        with pytest.raises(CheckpointTimeoutError, match="timed out"):
            make().recv_checkpoint(0, url, 1, timedelta(seconds=0.2))
        assert time.monotonic() - started < 5
    with pytest.raises(CheckpointError):
        make().recv_checkpoint(0, url, 1, timedelta(seconds=0))


def test_token_required_and_checked(
    make: Callable[..., HTTPTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    src = make(token="s3cret")
    src.send_checkpoint([1], 1, {"x": torch.arange(3)}, TIMEOUT)
    with pytest.raises(CheckpointError, match="401"):
        make().recv_checkpoint(0, src.metadata(), 1, TIMEOUT)
    with pytest.raises(CheckpointError, match=r"401.*wrong job token"):
        make(token="wrong").recv_checkpoint(0, src.metadata(), 1, TIMEOUT)
    out = make(token="s3cret").recv_checkpoint(0, src.metadata(), 1, TIMEOUT)
    assert torch.equal(out["x"], torch.arange(3))
    monkeypatch.setenv("TORCHHEAL_CHECKPOINT_TOKEN", "s3cret")
    assert torch.equal(make(3).recv_checkpoint(0, src.metadata(), 1, TIMEOUT)["x"], torch.arange(3))


def _canned_server(response: bytes) -> tuple[str, threading.Thread, socket.socket]:
    """A one-shot raw server that answers any request with ``response`` and hangs up."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)

    def serve() -> None:
        conn, _ = sock.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(response)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}/checkpoint/", thread, sock


def _http_ok(body: bytes, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % n + body


@pytest.mark.parametrize(
    ("damage", "expected"), [("flip", "checksum mismatch"), ("truncate", "truncated")]
)
def test_corrupted_or_truncated_transfer_detected(
    make: Callable[..., HTTPTransport], damage: str, expected: str
) -> None:
    body = bytearray(encode_bytes({"w": torch.randn(4000)}, 1, block_bytes=4096))
    if damage == "flip":
        body[-10] ^= 0x40
        response = _http_ok(bytes(body))
    else:
        response = _http_ok(bytes(body[:-500]), length=len(body))  # promises more than it sends
    url, thread, sock = _canned_server(response)
    with sock, pytest.raises(CheckpointError, match=expected):
        make().recv_checkpoint(0, url, 1, TIMEOUT)
    thread.join(5)


def test_peer_disconnecting_mid_transfer_does_not_kill_server(
    make: Callable[..., HTTPTransport],
) -> None:
    src = make()
    state = {"w": torch.randn(4 << 20)}  # 16 MB: larger than socket buffers
    src.send_checkpoint([1], 1, state, TIMEOUT)
    port = src._server.server_port
    for _ in range(2):
        with socket.create_connection(("localhost", port), timeout=5) as rude:
            rude.sendall(b"GET /checkpoint/1/full HTTP/1.0\r\n\r\n")
            assert rude.recv(1024).startswith(b"HTTP/1.0 200")
            rude.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
    out = make().recv_checkpoint(0, src.metadata(), 1, TIMEOUT)
    assert torch.equal(out["w"], state["w"])
    # No request hold was leaked by the aborted transfers.
    assert src._wait_requests_done(TIMEOUT.total_seconds())
    assert src._live is not None and src._live.requests == 0


def test_unsendable_state_is_refused_and_stays_disallowed(
    make: Callable[..., HTTPTransport],
) -> None:
    src = make()
    with pytest.raises(CheckpointError, match="object"):
        src.send_checkpoint([1], 1, {"bad": object()}, TIMEOUT)
    assert src._live is None


@pytest.mark.gpu
@pytest.mark.parametrize("num_chunks", [0, 3])
def test_round_trip_of_gpu_state(make: Callable[..., HTTPTransport], num_chunks: int) -> None:
    # A GPU job serves its live CUDA state; the healer gets the values on the CPU (as the
    # reference), also when its own state, the in-place target, lives on the GPU.
    src, dst = make(num_chunks, block_bytes=4096), make(num_chunks)
    state = {
        "w": torch.randn(20000, device="cuda"),
        "big": torch.randn(LIVE_FROM_BYTES // 2, device="cuda"),  # CPU ones this big go live
        "h": torch.randn(7, dtype=torch.bfloat16, device="cuda"),
        "cpu": torch.arange(5),
    }
    src.send_checkpoint([1], 5, state, TIMEOUT)
    own = {key: torch.zeros_like(value) for key, value in state.items()}
    for into in (None, own):
        out = dst.recv_checkpoint(0, src.metadata(), 5, TIMEOUT, into=into)
        for key, value in state.items():
            assert out[key].dtype == value.dtype and torch.equal(out[key].cpu(), value.cpu()), key
        assert out["w"].device.type == "cpu"


def _body(sock: socket.socket, first: bytes) -> bytes:
    """The body of the HTTP/1.0 response whose ``first`` bytes were read (the server closes
    the connection after it)."""
    data = bytearray(first)
    while chunk := sock.recv(1 << 20):
        data.extend(chunk)
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200"), head[:200]
    return body


def test_a_healer_stalled_mid_transfer_never_delays_the_next_heal(
    make: Callable[..., HTTPTransport],
) -> None:
    """A healer whose host froze (no FIN, no reads) part way through step 5's stream: the
    source goes on to serve steps 6 and 7 to other healers at once, not after the stalled
    socket's timeout, and nothing it does meanwhile reuses the buffers the stalled healer reads
    from: woken, it gets step 5 whole."""
    timeout = timedelta(seconds=60)  # the Manager's default; every wait below is under half
    src = make(timeout=timeout)
    state = {"w": torch.randn((32 << 20) // 4), "small": torch.arange(5.0)}  # far over buffers
    as_of = {5: {k: v.clone() for k, v in state.items()}}
    src.send_checkpoint([1], 5, state, timeout)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as stalled:
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        stalled.connect(("localhost", src._server.server_port))
        stalled.settimeout(timeout.total_seconds())
        stalled.sendall(b"GET /checkpoint/5/full HTTP/1.0\r\n\r\n")
        first = stalled.recv(1 << 16)  # it started, then stopped reading
        assert first.startswith(b"HTTP/1.0 200")
        for step in (6, 7):
            src.disallow_checkpoint()  # the optimizer step follows: the state changes
            state["w"].add_(1.0)
            state["small"].add_(1.0)
            as_of[step] = {k: v.clone() for k, v in state.items()}
            sent = threading.Thread(target=src.send_checkpoint, args=([1], step, state, timeout))
            sent.start()
            sent.join(timeout.total_seconds() / 2)
            assert not sent.is_alive(), "the next send waited for the stalled healer"
        # Step 6 had no healer: its freeze copies every block, into pool buffers that a
        # premature release of step 5's would hand out again.
        src.disallow_checkpoint()
        state["w"].add_(1.0)
        healer = make(timeout=timedelta(seconds=30))
        assert_same(healer.recv_checkpoint(0, src.metadata(), 7, timeout), as_of[7])
        body = _body(stalled, first)
    assert_same(decode_bytes(body), as_of[5])
    assert src._wait_requests_done(timeout.total_seconds() / 2)


def test_a_request_during_a_new_send_of_the_served_step_waits_for_it(
    make: Callable[..., HTTPTransport],
) -> None:
    # A source may stage the step it already serves again (a new quorum with a healer, after
    # the last one failed): a request that comes while it stages waits for the new copy.
    src, dst = make(), make()
    big = torch.arange(50_000_000, dtype=torch.float32)  # 200 MB: staging takes a while
    src.send_checkpoint([1], 5, {"x": big}, TIMEOUT)
    src.disallow_checkpoint()
    restaging = threading.Thread(target=src.send_checkpoint, args=([1], 5, {"x": big}, TIMEOUT))
    restaging.start()
    deadline = time.monotonic() + 10
    while src._live is not None or src._staging != 5:  # the new send is under way
        assert time.monotonic() < deadline, "the second send never began"
        time.sleep(0.001)
    got = dst.recv_checkpoint(0, src.metadata(), 5, TIMEOUT)
    restaging.join(30)
    assert torch.equal(got["x"], big)
