"""Hostile checkpoint streams fed end to end to the real receiving transports.

* HTTP: a hostile server in its own process (:mod:`tests.fuzz.evil_http`) serves each stream;
  a real ``HTTPTransport`` fetches it as one stream or in 2 chunks, with or without a
  ``Content-Length``.
* PG: a hostile sender in its own process (:mod:`tests.fuzz.evil_pg`) sends each stream over a
  real Gloo group to a ``PGTransport`` that receives in place into a template state dict; a
  refused transfer must leave every template tensor as it was.
* decoder: the in-memory decoder with a template (``decode_bytes``), the in-place path of tests.

Each stream is first judged by ``decode_bytes`` without a template (the oracle). A receiver
must refuse what the oracle refuses, with ``CheckpointError``, and load what it loads, equal to
the oracle's state; any other exception, a hang, or a disagreement is unclear.
"""

from __future__ import annotations

import multiprocessing
import struct
import subprocess
import sys
import tempfile
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st

from tests.fuzz.checkpoint_inputs import (
    STEP,
    HostileStream,
    base_state,
    base_stream,
    known_streams,
    split,
)
from tests.fuzz.checkpoint_inputs import hostile_streams as hostile
from tests.fuzz.evil_pg import serve
from tests.fuzz.grpc_targets import REPO
from tests.fuzz.runner import ACCEPTED, REJECTED, UNCLEAR, Outcome
from torchheal.checkpointing import CheckpointError, HTTPTransport
from torchheal.checkpointing._format import MAX_DESCRIPTION_BYTES, split_chunks
from torchheal.checkpointing.deserialization import Description, parse_description
from torchheal.checkpointing.pg_transport import (
    _TAG_DATA,
    _TAG_DESCRIPTION,
    _TAG_LENGTH,
    _TAG_PACKED,
    PGTransport,
    _packed_layout,
)
from torchheal.checkpointing.serialization import HEADER, MAGIC, decode_bytes
from torchheal.process_group.gloo import ProcessGroupGloo

TIMEOUT_S = 2.0  # each wait of a receive
GROUP_TIMEOUT_S = 20.0  # a Gloo group's rendezvous (a loaded machine can be slow)


def _parsed(stream: bytes) -> tuple[Description | None, int]:
    """The stream's description when it parses with its header, and where its data starts."""
    if len(stream) < HEADER.size:
        return None, len(stream)
    _, length, crc = HEADER.unpack(stream[: HEADER.size])
    end = HEADER.size + length
    try:
        return parse_description(stream[HEADER.size : end], crc), end
    except Exception:  # the oracle reports a parser that raises anything but CheckpointError
        return None, end


def effective(stream: bytes) -> bytes:
    """The bytes a receiver reads: a described stream without its trailing extra bytes.

    A receiver reading by the description (in chunks, or without a Content-Length) never
    asks for bytes past the data it describes; the oracle judges what is read.
    """
    desc, start = _parsed(stream)
    return stream if desc is None else stream[: start + desc.data_bytes]


def oracle(stream: bytes, step: int | None = STEP) -> tuple[Any, str | None]:
    """(state, None) when the in-memory decoder loads ``stream`` and it is of ``step`` (the
    step the transports ask for; None: any), else (None, why not).

    Raises:
        AssertionError: the decoder raised something other than ``CheckpointError``.
    """
    desc, _ = _parsed(stream)
    if step is not None and desc is not None and desc.step != step:
        return None, f"step {desc.step}, not {STEP}"
    try:
        return decode_bytes(stream), None
    except CheckpointError as e:
        return None, str(e)
    except Exception as e:
        raise AssertionError(f"the decoder raised {type(e).__name__}: {e}") from e


def same(a: Any, b: Any) -> bool:
    """Structural equality of two decoded states (tensors by value and dtype)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(_raw(a), _raw(b))  # bytes: dtypes without == (complex32) too
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN equals NaN here


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


# The oracle cannot rebuild a DTensor without a default process group (none in this test
# process); a receiver filling a plain template tensor in place never needs to.
NO_VERDICT = "cannot rebuild DTensor"


def judge(read: bytes, receive: Any, step: int | None = STEP) -> Outcome:
    """Run ``receive()`` and compare its verdict with the oracle's on the bytes it ``read``."""
    try:
        expected, refusal = oracle(read, step)
    except AssertionError as e:
        return Outcome(UNCLEAR, str(e))
    undecided = refusal is not None and NO_VERDICT in refusal
    try:
        got = receive()
    except CheckpointError as e:
        if refusal is None:
            return Outcome(UNCLEAR, f"refused a stream the decoder loads: {e}")
        return Outcome(REJECTED, f"CheckpointError: {e}")
    except Exception as e:
        return Outcome(UNCLEAR, f"raised {type(e).__name__} instead of CheckpointError: {e}")
    if undecided:
        return Outcome(ACCEPTED, "loaded (a DTensor entry, into a plain template tensor)")
    if refusal is not None:
        return Outcome(UNCLEAR, f"loaded a stream the decoder refuses ({refusal})")
    if not same(got, expected):
        return Outcome(UNCLEAR, "loaded a state that differs from the decoder's")
    return Outcome(ACCEPTED, "loaded (a valid stream)")


class HttpReceiverTarget:
    """``HTTPTransport.recv_checkpoint`` against a hostile server process."""

    name = "checkpoint HTTP receiver"

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="torchheal-fuzz-")
        self.root = Path(self._dir.name)
        self.child = subprocess.Popen(
            [sys.executable, "-m", "tests.fuzz.evil_http", str(self.root)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.child.stdout is not None
        line = self.child.stdout.readline()
        if not line.startswith("port "):
            raise RuntimeError(f"hostile server failed to start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}/checkpoint/"
        self.receivers = {
            chunks: HTTPTransport(timeout=TIMEOUT_S, num_chunks=chunks, hostname="127.0.0.1")
            for chunks in (0, 2)
        }

    def inputs(self) -> st.SearchStrategy[Any]:
        modes = st.sampled_from([(0, "length")] * 2 + [(0, "close"), (2, "length")])
        return st.tuples(hostile(), modes)

    def known(self) -> list[Any]:
        modes = [(0, "length"), (0, "close"), (2, "length")]
        return [(stream, mode) for stream in known_streams() for mode in modes]

    def _serve(self, stream: bytes, chunks: int, mode: str) -> None:
        header_desc = stream
        desc, start = _parsed(stream)
        (self.root / "full").write_bytes(stream)
        (self.root / "mode").write_text(mode)
        if desc is not None:
            header_desc = stream[:start]
            data = stream[start:]
            # Chunk i holds the bytes of its segments; the last one all that is left.
            pos = 0
            for i, segments in enumerate(split_chunks(desc.segments, chunks or 1)):
                n = sum(s.end - s.start for s in segments)
                last = i == (chunks or 1) - 1
                (self.root / f"chunk{i}").write_bytes(data[pos:] if last else data[pos : pos + n])
                pos += n
        (self.root / "metadata").write_bytes(header_desc)

    def send(self, value: tuple[HostileStream, tuple[int, str]]) -> Outcome:
        hostile_stream, (chunks, mode) = value
        stream = hostile_stream.stream
        self._serve(stream, chunks, mode)
        receiver = self.receivers[chunks]
        # Without a Content-Length the receiver reads by the description (it never asks for
        # bytes past the described data); otherwise every byte served counts.
        read = effective(stream) if (chunks, mode) == (0, "close") else stream
        return judge(read, lambda: receiver.recv_checkpoint(0, self.url, STEP))

    def snapshot(self) -> Any:
        return None  # a receiver keeps no state between transfers

    def alive(self) -> str | None:
        code = self.child.poll()
        return None if code is None else f"the hostile server exited ({code})"

    def normal(self) -> str | None:
        self._serve(base_stream(), 0, "length")
        try:
            got = self.receivers[0].recv_checkpoint(0, self.url, STEP)
        except Exception as e:
            return str(e)
        return None if same(got, base_state()) else "received a different state"

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.shutdown()
        assert self.child.stdin is not None
        self.child.stdin.close()
        self.child.wait(10)
        self._dir.cleanup()


def template_state() -> dict[str, Any]:
    """A live state to receive into: same layout as the base state, other values."""
    w = torch.full((3000,), -1.0)
    return {
        "model": {"w": w, "b": torch.full((16,), -1.0), "tied": w[10:20]},
        "big": torch.full((300_000,), -1, dtype=torch.int32),
        "opt": [{"step": 0, "lr": 0.0, "betas": (0.0, 0.0)}, None],
        "name": "",
        "flags": torch.tensor([False, True]),
    }


def digest(state: Any) -> tuple[int, ...]:
    """CRC-32 of every tensor's bytes in a state (the template must keep it on a refusal)."""
    out: list[int] = []

    def walk(node: Any) -> None:
        if isinstance(node, torch.Tensor):
            out.append(zlib.crc32(_raw(node).numpy().tobytes()))
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list | tuple):
            for v in node:
                walk(v)

    walk(state)
    return tuple(out)


def pg_messages(stream: bytes) -> list[tuple[int, bytes]]:
    """What a hostile PG sender sends for ``stream``: never longer than the receiver posts.

    The length message carries the header's length and CRC; the description is cut to that
    length (a longer message would abort the receiving process inside Gloo); data messages
    follow the description when it parses, each at most its storage's size.
    """
    if len(stream) < HEADER.size:
        return [(_TAG_LENGTH, struct.pack("<qq", len(stream), 0))]
    _, length, crc = HEADER.unpack(stream[: HEADER.size])
    signed = length - (1 << 64) if length >= 1 << 63 else length
    messages = [(_TAG_LENGTH, struct.pack("<qq", signed, crc))]
    if not 0 < signed <= MAX_DESCRIPTION_BYTES:
        return messages
    text = stream[HEADER.size : HEADER.size + length]
    messages.append((_TAG_DESCRIPTION, text))
    desc, start = _parsed(stream)
    if desc is None or desc.step != STEP:
        return messages
    data = stream[start:]
    offsets, packed_bytes = _packed_layout(desc.storage_nbytes)
    starts = [sum(desc.storage_nbytes[:i]) for i in range(len(desc.storage_nbytes))]
    if packed_bytes:
        packed = bytearray(packed_bytes)
        end = 0  # the packed message stops where the stream's data does (cut short: shorter)
        for i, off in offsets.items():
            piece = data[starts[i] : starts[i] + desc.storage_nbytes[i]]
            packed[off : off + len(piece)] = piece
            if piece:
                end = off + len(piece)
        full = len(data) >= desc.data_bytes
        messages.append((_TAG_PACKED, bytes(packed if full else packed[:end])))
    for i, n in enumerate(desc.storage_nbytes):
        if n and i not in offsets:
            messages.append((_TAG_DATA + i, data[starts[i] : starts[i] + n]))
    return messages


def whole_after_all(stream: bytes, got: Any) -> bool:
    """A PG transfer of a stream cut short that loaded exactly the uncut stream's state.

    A Gloo message shorter than the receive posted for it completes, and the receiver cannot
    tell how many bytes it carried: the missing tail keeps what the receive buffer held. When
    that equals what the sender left out (a large storage's staging buffer reused from an
    earlier transfer of the same state, or zeros where the state has zeros), every block
    checks out and the state loaded is the sender's, bit for bit: right, not a partial load.
    Anything else loaded from a cut stream stays a finding.
    """
    return base_stream().startswith(stream) and same(got, base_state())


class PgReceiverTarget:
    """``PGTransport.recv_checkpoint`` into a template, against a hostile sender process."""

    name = "checkpoint PG receiver (in place)"

    def __init__(self) -> None:
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.child = ctx.Process(
            target=serve,
            args=(self.store.port, child_conn, TIMEOUT_S, GROUP_TIMEOUT_S),
            daemon=True,
        )
        self.child.start()
        child_conn.close()
        # The child imports torch before its first job; a group's rendezvous must not wait on it.
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError("the hostile sender did not start")
        self.jobs = 0
        self.template = template_state()
        self.pristine = digest(self.template)

    def inputs(self) -> st.SearchStrategy[HostileStream]:
        return hostile()

    def known(self) -> list[Any]:
        return known_streams()

    def _transfer(self, stream: bytes) -> Any:
        """Receive ``stream`` from the hostile sender; returns what ``recv_checkpoint`` does."""
        self.jobs += 1
        prefix = f"fuzz{self.jobs}"
        self.conn.send((prefix, pg_messages(stream)))
        pg = ProcessGroupGloo(timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        try:
            pg.configure(f"127.0.0.1:{self.store.port}/{prefix}", "victim", 1, 2)
            transport: PGTransport[Any] = PGTransport(
                pg, timedelta(seconds=TIMEOUT_S), "cpu", state_dict=lambda: self.template
            )
            return transport.recv_checkpoint(0, "<n/a>", STEP)
        finally:
            self.conn.send("done")
            if not self.conn.poll(30):
                raise RuntimeError("the hostile sender did not finish its job")
            self.conn.recv()
            pg.shutdown()

    def send(self, value: HostileStream) -> Outcome:
        stream = value.stream
        if len(stream) >= HEADER.size:
            # A PG transfer carries no magic (its length message has only length and CRC).
            _, length, crc = HEADER.unpack(stream[: HEADER.size])
            stream = HEADER.pack(MAGIC, length, crc) + stream[HEADER.size :]
        got: list[Any] = []
        outcome = judge(
            effective(stream), lambda: got.append(self._transfer(value.stream)) or got[0]
        )
        if outcome.kind == UNCLEAR and got and whole_after_all(value.stream, got[0]):
            outcome = Outcome(ACCEPTED, "loaded the whole state from a stream cut short")
        if outcome.kind == ACCEPTED:
            self.template = template_state()  # filled in place: start the next from scratch
        return outcome

    def snapshot(self) -> Any:
        return digest(self.template)

    def alive(self) -> str | None:
        return None if self.child.is_alive() else f"the sender exited ({self.child.exitcode})"

    def normal(self) -> str | None:
        try:
            got = self._transfer(base_stream())
        except Exception as e:
            return str(e)
        w = self.template["model"]["w"]
        self.template = template_state()
        if not same(got, base_state()) or got["model"]["w"] is not w:
            return "did not receive the state in place"
        return None

    def close(self) -> None:
        self.conn.close()
        self.child.join(30)
        self.store = None  # type: ignore[assignment]


class DecoderTarget:
    """``decode_bytes`` into a template (in place), in memory."""

    name = "checkpoint decoder (in place)"

    def __init__(self) -> None:
        self.template = template_state()

    def inputs(self) -> st.SearchStrategy[HostileStream]:
        return hostile()

    def known(self) -> list[Any]:
        return known_streams()

    def send(self, value: HostileStream) -> Outcome:
        read = effective(value.stream)
        outcome = judge(read, lambda: decode_bytes(read, self.template), step=None)
        if outcome.kind == ACCEPTED:
            self.template = template_state()
        return outcome

    def snapshot(self) -> Any:
        return digest(self.template)

    def alive(self) -> str | None:
        return None

    def normal(self) -> str | None:
        got = decode_bytes(base_stream(), self.template)
        ok = same(got, base_state()) and got["model"]["w"] is self.template["model"]["w"]
        self.template = template_state()
        return None if ok else "did not decode the state in place"

    def close(self) -> None:
        pass


def all_targets() -> dict[str, Any]:
    """Constructors of the receiver targets, by table name."""
    return {
        HttpReceiverTarget.name: HttpReceiverTarget,
        PgReceiverTarget.name: PgReceiverTarget,
        DecoderTarget.name: DecoderTarget,
    }


__all__ = ["all_targets", "split"]
