"""Generated gRPC inputs: raw protobuf bytes, well-formed hostile messages, raw HTTP/2 calls.

Three families, for any request type of the ``torchft`` protocol:

* **malformed bytes**: garbage, valid messages cut short, another message type, 10+ byte
  varints, absurd lengths, invalid UTF-8 in string fields, invalid wire types and field 0,
  groups nested thousands deep, a field repeated 100,000 times;
* **hostile values** in well-formed messages: extreme and negative integers, empty, huge and
  strange Unicode strings (NUL, bidi overrides, combining marks, 4-byte characters, path
  traversal, format strings), ``data`` JSON that is NaN, infinite, deep or not an object, and
  unknown fields;
* **raw HTTP/2 calls** (:mod:`tests.fuzz.h2call`): ``grpc-timeout`` values from ``0n`` to
  ``99999999H`` and malformed ones, wrong content types, missing ``te``, unknown encodings, a
  compressed flag without an encoding, length prefixes that lie, several messages in one call.

Each input also carries how it is sent: the ``grpc`` client with a timeout (None: no deadline)
or a raw HTTP/2 call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from tests.fuzz.h2call import frame
from torchheal._wire import session_pb2 as spb  # noqa: F401  (registers the session types)
from torchheal._wire import torchft_pb2 as pb

_POOL = descriptor_pool.Default()

INT64 = (-(1 << 63), (1 << 63) - 1)
UINT64 = (0, (1 << 64) - 1)
INT_RANGES = {
    FieldDescriptor.TYPE_INT64: INT64,
    FieldDescriptor.TYPE_UINT64: UINT64,
    FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
}


def int_range(f: FieldDescriptor) -> tuple[int, int]:
    """The values an integer field can hold."""
    return INT_RANGES[f.type]


ALL_MESSAGES: tuple[type[Message], ...] = (
    pb.QuorumMember,
    pb.Quorum,
    pb.LighthouseQuorumRequest,
    pb.LighthouseQuorumResponse,
    pb.LighthouseHeartbeatRequest,
    pb.ManagerQuorumRequest,
    pb.ManagerQuorumResponse,
    pb.CheckpointMetadataRequest,
    pb.CheckpointMetadataResponse,
    pb.ShouldCommitRequest,
    pb.ShouldCommitResponse,
    pb.KillRequest,
)

# Strings that have broken parsers, loggers, path handling and terminals before.
WEIRD_TEXT = [
    "",
    " ",
    "\x00",
    "a\x00b",
    "\u202eevil",
    "\ufeffbom",
    "\u200b",
    "e\u0301\u0301\u0301",
    "\U0001f642" * 3,
    "\U0010ffff",
    "../../../../etc/passwd",
    "%s%s%s%n",
    "{0}{1}",
    "${jndi:ldap://x}",
    "<script>alert(1)</script>",
    "\r\nInjected: header",
    "http://[::1]:0",
    "[::1]:-1",
    ":",
    "a:b:c:d",
    "null",
    "NaN",
    "-0",
    "1e999",
]
# The deepest first: hypothesis draws the first entries of a list more often.
WEIRD_DATA = [
    "[" * 100_000,
    '{"a":' * 50_000,
    '{"a": NaN}',
    '{"a": Infinity, "b": -Infinity}',
    '{"a": 1e999}',
    '{"a": -0.0}',
    '{"a": ' * 500 + "1" + "}" * 500,
    '"a string"',
    "[]",
    "null",
    "{}",
    '{"k": "' + "x" * 10_000 + '"}',
    "{",
    '{"a": "\\ud800"}',
]
TIMEOUTS: list[float | None] = [None, 1e-6, 0.002, 0.2, 3.0, 3600.0, 4e9]
# grpc-timeout header values gRPC accepts (up to 9 digits: it is lenient), and some it refuses.
HEADER_TIMEOUTS = [None, "1n", "0n", "100m", "1S", "99999999H", "9999999H", "99999999M"]
HEADER_TIMEOUTS += ["123456789S", "99999999u"]
BAD_HEADER_TIMEOUTS = ["abc", "-1S", "1.5S", "", "1H1M", "5"]


@dataclass(frozen=True)
class RawH2:
    """A call sent with :func:`tests.fuzz.h2call.raw_call`.

    Args:
        headers: the regular headers, in order.
        body: the raw DATA bytes.
        compliant: the headers are a valid gRPC request (so a reset is not an answer).
    """

    headers: tuple[tuple[str, str], ...]
    body: bytes
    compliant: bool


@dataclass(frozen=True, repr=False)
class GrpcInput:
    """One input for a gRPC method.

    Args:
        kind: which family made it, for reports.
        payload: the serialized request (what a raw call frames, unless ``raw`` says more).
        timeout: the client's deadline in seconds (None: none), when sent by the grpc client.
        raw: set to send a raw HTTP/2 call instead.
    """

    kind: str
    payload: bytes
    timeout: float | None = 5.0
    raw: RawH2 | None = None

    def __repr__(self) -> str:
        body = self.payload if len(self.payload) <= 120 else self.payload[:120] + b"..."
        raw = "" if self.raw is None else f", raw={self.raw.headers!r}, body={len(self.raw.body)}B"
        return f"GrpcInput({self.kind}, {len(self.payload)}B {body!r}, timeout={self.timeout}{raw})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # hypothesis would print every field (megabytes) otherwise


def parses(message: type[Message], data: bytes) -> bool:
    """Whether ``data`` is a valid serialized ``message`` (the server's parser decides)."""
    try:
        message.FromString(data)
    except DecodeError:
        return False
    return True


# --------------------------------------------------------------------------------------------
# Values


@functools.cache
def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers in [lo, hi], biased to the edges and to small values."""
    edges = [v for v in (lo, lo + 1, -1, 0, 1, 2, 7, (1 << 31) - 1, 1 << 31, 1 << 62, hi - 1, hi)]
    small = st.integers(max(lo, -3), min(hi, 3))
    return st.one_of(
        st.sampled_from([v for v in edges if lo <= v <= hi]), small, st.integers(lo, hi)
    )


@functools.cache
def texts() -> st.SearchStrategy[str]:
    """Hostile strings: weird, random Unicode, or huge (1 KiB to past gRPC's 4 MiB limit)."""
    huge = st.builds(
        lambda n, c: c * (n // len(c.encode())),
        st.sampled_from([1 << 10, 1 << 16, 1 << 20, (4 << 20) + 64]),
        st.sampled_from(["x", "\u00e9", "\U0001f642", "\x00"]),
    )
    return st.one_of(st.sampled_from(WEIRD_TEXT), st.text(max_size=40), huge)


@functools.cache
def data_texts() -> st.SearchStrategy[str]:
    """``QuorumMember.data`` values: JSON edge cases, deep or not objects, or any text."""
    return st.one_of(st.sampled_from(WEIRD_DATA), st.sampled_from(WEIRD_DATA), texts())


# Plausible values by field name: a message with one hostile field among plausible ones gets
# past the first check and reaches the code behind it.
PLAUSIBLE: dict[str, st.SearchStrategy[object]] = {
    "replica_id": st.sampled_from(["fuzz:1", "fuzz:2", "a:0b5f0a4e-7c1e-4a8e"]),
    "address": st.just("http://127.0.0.1:1"),
    "store_address": st.just("127.0.0.1:2"),
    "data": st.sampled_from(["", '{"k": 1}']),
    "checkpoint_metadata": st.just("http://127.0.0.1:1/checkpoint/"),
    "msg": st.just("fuzz"),
}


@functools.cache
def _field_value(f: FieldDescriptor, depth: int) -> st.SearchStrategy[object]:
    """Half the time a plausible value for the field, otherwise a hostile one."""
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        if f.message_type.full_name == "google.protobuf.Timestamp":
            return st.tuples(ints(-(1 << 40), 1 << 40), ints(0, 999_999_999))
        return hostile(_class_of(f.message_type.full_name), depth + 1)
    if f.type == FieldDescriptor.TYPE_STRING:
        bad = data_texts() if f.name == "data" else texts()
        good = PLAUSIBLE.get(f.name, st.just("x"))
    elif f.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    else:
        bad = ints(*int_range(f))
        good = st.integers(0, 3) if "rank" in f.name else st.integers(0, 1000)
    return st.one_of(good, bad)


def _class_of(full_name: str) -> type[Message]:
    """The generated class of a message type (torchft's, torchheal's session types...)."""
    return GetMessageClass(_POOL.FindMessageTypeByName(full_name))


_UNSET = st.sampled_from([True, False, False, False])  # a field is left unset 1 time in 4


@functools.cache
def hostile(message: type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
    """Well-formed ``message`` instances with hostile values in any subset of their fields."""

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = message()
        if not message.DESCRIPTOR.fields:
            draw(st.just(None))  # an empty message (e.g. Heartbeat {}): nothing to choose
        for f in message.DESCRIPTOR.fields:
            if depth > 2 or draw(_UNSET):
                continue
            values = [draw(_field_value(f, depth))]
            if f.is_repeated:
                values = draw(_repeated(f, depth))
            for value in values:
                _set(msg, f, value)
        return msg

    return build()


@functools.cache
def _repeated(f: FieldDescriptor, depth: int) -> st.SearchStrategy[list[object]]:
    return st.lists(_field_value(f, depth), max_size=5)


def _set(msg: Message, f: FieldDescriptor, value: object) -> None:
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        if isinstance(value, tuple):  # a Timestamp
            getattr(msg, f.name).seconds, getattr(msg, f.name).nanos = value
        elif f.is_repeated:
            getattr(msg, f.name).append(value)
        else:
            getattr(msg, f.name).CopyFrom(value)
    elif f.is_repeated:
        getattr(msg, f.name).append(value)
    else:
        setattr(msg, f.name, value)


# --------------------------------------------------------------------------------------------
# Bytes


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative integer (any size: longer than 10 bytes too)."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    """A field key."""
    return varint(number << 3 | wire_type)


def unknown_fields() -> st.SearchStrategy[bytes]:
    """Well-formed fields with numbers no torchft message uses (a newer peer's)."""
    number = st.integers(9, (1 << 29) - 1)
    return st.one_of(
        st.builds(lambda n, v: tag(n, 0) + varint(v), number, st.integers(0, (1 << 64) - 1)),
        st.builds(lambda n, b: tag(n, 2) + varint(len(b)) + b, number, st.binary(max_size=32)),
        st.builds(lambda n, b: tag(n, 1) + b, number, st.binary(min_size=8, max_size=8)),
        st.builds(lambda n, b: tag(n, 5) + b, number, st.binary(min_size=4, max_size=4)),
    )


def malformed(message: type[Message]) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, bytes) that are broken or odd at the byte level (most do not parse)."""
    string_fields = [
        f.number for f in message.DESCRIPTOR.fields if f.type == FieldDescriptor.TYPE_STRING
    ]
    any_field = st.integers(1, 12)
    wellformed = hostile(message).map(lambda m: m.SerializeToString())
    kinds: list[st.SearchStrategy[tuple[str, bytes]]] = [
        st.binary(max_size=64).map(lambda b: ("garbage", b)),
        st.binary(min_size=1024, max_size=4096).map(lambda b: ("garbage", b)),
        st.builds(
            lambda b, cut: ("truncated", b[: int(len(b) * cut)]),
            wellformed.filter(len),
            st.floats(0, 0.999),
        ),
        st.builds(
            lambda cls, m: ("other message type", m),
            st.sampled_from(ALL_MESSAGES),
            st.sampled_from(ALL_MESSAGES).flatmap(hostile).map(lambda m: m.SerializeToString()),
        ),
        st.builds(
            lambda n, extra: ("huge varint", tag(n, 0) + b"\xff" * (9 + extra) + b"\x01"),
            any_field,
            st.integers(0, 20),
        ),
        st.builds(
            lambda n, length: ("absurd length", tag(n, 2) + varint(length) + b"abc"),
            any_field,
            st.sampled_from([4, 1 << 31, (1 << 32) + 3, (1 << 63) - 1, (1 << 64) - 1]),
        ),
        st.builds(
            lambda n, w: ("invalid wire type", tag(n, w) + b"\x01\x02"),
            any_field,
            st.sampled_from([6, 7]),
        ),
        st.just(("field zero", b"\x00\x01")),
        st.builds(
            lambda n, depth, closed: (
                "nested groups",
                tag(n, 3) * depth + (tag(n, 4) * depth if closed else b""),
            ),
            st.integers(9, 20),
            st.sampled_from([1, 10, 99, 100, 101, 1_000, 100_000]),
            st.booleans(),
        ),
        st.builds(
            lambda depth: ("nested messages", _nested(depth)),
            st.sampled_from([10, 100, 1_000, 10_000]),
        ),
        st.builds(
            lambda field_bytes, count: ("repeated field", field_bytes * count),
            unknown_fields(),
            st.sampled_from([1_000, 100_000]),
        ),
    ]
    if string_fields:
        kinds.append(
            st.builds(
                lambda n, bad: ("bad utf-8", tag(n, 2) + varint(len(bad)) + bad),
                st.sampled_from(string_fields),
                st.sampled_from(
                    [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"a\xfeb"]
                ),
            )
        )
    return st.one_of(kinds)


@functools.cache
def _nested(depth: int) -> bytes:
    # Unknown field 15 holding a message holding a message ... (length-delimited each time).
    inner = b""
    for _ in range(depth):
        inner = tag(15, 2) + varint(len(inner)) + inner
    return inner


def well_formed(message: type[Message]) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, bytes) of ``message`` with hostile values, optionally with unknown fields."""
    return st.builds(
        lambda m, extra: ("hostile values", m.SerializeToString() + b"".join(extra)),
        hostile(message),
        st.one_of(st.just([]), st.lists(unknown_fields(), max_size=3)),
    )


def plausible(message: type[Message]) -> Message:
    """A ``message`` whose every field holds a plausible value."""
    msg = message()
    for f in message.DESCRIPTOR.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if f.message_type.full_name == "google.protobuf.Timestamp":
                getattr(msg, f.name).seconds = 1
            elif not f.is_repeated:
                getattr(msg, f.name).CopyFrom(plausible(_class_of(f.message_type.full_name)))
        elif f.type == FieldDescriptor.TYPE_STRING:
            _set(msg, f, {"replica_id": "fuzz:1", "data": '{"k": 1}'}.get(f.name, "x"))
        elif f.type == FieldDescriptor.TYPE_BOOL:
            _set(msg, f, False)
        else:
            _set(msg, f, 0 if "rank" in f.name else 1)
    return msg


HOSTILE_INT64 = [-(1 << 63), -1, 0, 1 << 31, 1 << 62, (1 << 63) - 1]
HOSTILE_UINT64 = [0, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
HUGE_TEXT = ["x" * (1 << 16), "\U0001f642" * (1 << 18), "x" * ((4 << 20) + 64)]


@functools.cache
def corpus(message: type[Message]) -> tuple[tuple[str, bytes], ...]:
    """Every known hostile value in every field, one at a time, the other fields plausible.

    Hypothesis draws from a large space and may never combine, say, JSON nested 100,000 deep
    with a request that passes every other check; this list makes sure each such value
    reaches the code behind the checks.
    """
    out = []

    def each(msg: Message, path: list[FieldDescriptor]) -> None:
        for f in type(msg).DESCRIPTOR.fields:
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                if f.message_type.full_name != "google.protobuf.Timestamp" and not f.is_repeated:
                    each(getattr(msg, f.name), [*path, f])
                continue
            if f.type == FieldDescriptor.TYPE_STRING:
                values: list[object] = WEIRD_TEXT + HUGE_TEXT
                values = WEIRD_DATA + values if f.name == "data" else values
            elif f.type == FieldDescriptor.TYPE_BOOL:
                values = [True]
            else:
                lo, hi = int_range(f)
                values = [v for v in HOSTILE_INT64 + HOSTILE_UINT64 if lo <= v <= hi]
                values = sorted(set(values), key=values.index)
            for value in values:
                root = plausible(message)
                target = root
                for step in path:
                    target = getattr(target, step.name)
                target.ClearField(f.name)
                _set(target, f, value)
                name = ".".join(p.name for p in [*path, f])
                negative = isinstance(value, int) and value < 0
                out.append((not negative, f"hostile {name}", root.SerializeToString()))

    each(plausible(message), [])
    # Negative values first: an accepted request can make later ones stale (a settled vote
    # refuses every earlier step), which would hide whether a negative step is refused.
    out.sort(key=lambda entry: entry[0])
    return tuple((kind, data) for _, kind, data in out)


# --------------------------------------------------------------------------------------------
# Whole inputs


def grpc_inputs(
    message: type[Message], *, timeouts: list[float | None] | None = None
) -> st.SearchStrategy[GrpcInput]:
    """Every family of input for a method taking ``message``.

    Args:
        message: the request type.
        timeouts: client deadlines to draw from (default :data:`TIMEOUTS`).
    """
    deadlines = st.sampled_from(timeouts or TIMEOUTS)
    good, bad = well_formed(message), malformed(message)
    known = st.sampled_from(corpus(message))
    raw = raw_inputs(st.one_of(good, bad, known))
    # Mostly through the grpc client (25% generated well-formed, 20% the known hostile
    # values, 35% malformed), 20% raw HTTP/2.
    families = st.sampled_from(["good"] * 5 + ["known"] * 4 + ["bad"] * 7 + ["raw"] * 4)
    payloads = {"good": good, "known": known, "bad": bad}

    @st.composite
    def build(draw: st.DrawFn) -> GrpcInput:
        family = draw(families)
        if family == "raw":
            return draw(raw)
        kind, payload = draw(payloads[family])
        return GrpcInput(kind, payload, draw(deadlines))

    return build()


def malformed_only(message: type[Message]) -> st.SearchStrategy[GrpcInput]:
    """Inputs that never parse as ``message`` (for ``Kill``: a parsed one ends the process).

    A candidate that happens to parse gets a truncated field appended: the parser reaches it
    at a field boundary and fails.
    """

    def spoil(kind_payload: tuple[str, bytes]) -> tuple[str, bytes]:
        kind, payload = kind_payload
        if parses(message, payload):
            return kind + " + truncated field", payload + tag(1, 2) + varint(5) + b"ab"
        return kind, payload

    payloads = st.one_of(malformed(message), well_formed(message)).map(spoil)
    deadlines = st.sampled_from(TIMEOUTS[1:])
    raw = raw_inputs(payloads, complete_only=True)
    by_client = st.sampled_from([True] * 3 + [False])

    @st.composite
    def build(draw: st.DrawFn) -> GrpcInput:
        if not draw(by_client):
            return draw(raw)
        kind, payload = draw(payloads)
        return GrpcInput(kind, payload, draw(deadlines))

    return build()


# Headers of a raw call: valid ones (9 calls in 10), or any (gRPC answers a malformed header
# only after ~0.1-0.9 s, so those are kept rare to keep the run short).
_VALID_HEADERS = st.fixed_dictionaries(
    {
        "content-type": st.sampled_from(["application/grpc", "application/grpc+proto"]),
        "te": st.just("trailers"),
        "grpc-timeout": st.sampled_from(HEADER_TIMEOUTS),
        "grpc-encoding": st.sampled_from([None, None, "identity", "gzip"]),
        "extra": st.lists(
            st.tuples(
                st.sampled_from(["x-evil", "authorization", "user-agent"]),
                st.sampled_from(["", "a", "Bearer x", "\u202eevil", "\U0001f642", "a" * 8000]),
            ),
            max_size=2,
        ),
    }
)
_ANY_HEADERS = st.fixed_dictionaries(
    {
        "content-type": st.sampled_from(
            ["application/grpc", "application/grpc+json", "text/plain", "", None]
        ),
        "te": st.sampled_from(["trailers", None, "gzip"]),
        "grpc-timeout": st.sampled_from(HEADER_TIMEOUTS + BAD_HEADER_TIMEOUTS),
        "grpc-encoding": st.sampled_from([None, "deflate", "x-evil", ""]),
        "extra": st.lists(
            st.tuples(
                st.sampled_from(["x-evil", "grpc-xyz", "x-bin", "authorization", "user-agent"]),
                st.sampled_from(
                    [v for v in WEIRD_TEXT[:12] if not set(v) & set("\r\n\x00")] + ["a" * 8000]
                ),
            ),
            max_size=3,
        ),
    }
)
_HEADERS = st.integers(0, 9).flatmap(lambda i: _ANY_HEADERS if i == 0 else _VALID_HEADERS)
_FRAMINGS = st.sampled_from(
    ["whole"] * 4 + ["compressed", "short", "long", "twice", "prefix", "empty"]
)


def raw_inputs(
    payloads: st.SearchStrategy[tuple[str, bytes]], *, complete_only: bool = False
) -> st.SearchStrategy[GrpcInput]:
    """Raw HTTP/2 calls: odd headers and framing around ``payloads``.

    Every call is meant to be answered: one whose body is incomplete carries a short
    ``grpc-timeout`` (otherwise the server would rightly wait for the rest).

    Args:
        payloads: (kind, serialized request) to frame.
        complete_only: only complete, uncompressed bodies (the server must parse them).
    """

    @st.composite
    def build(draw: st.DrawFn) -> GrpcInput:
        kind, payload = draw(payloads)
        chosen = draw(_HEADERS)
        content_type, te = chosen["content-type"], chosen["te"]
        timeout, encoding = chosen["grpc-timeout"], chosen["grpc-encoding"]
        framing = "whole" if complete_only else draw(_FRAMINGS)
        body = {
            "whole": frame(payload),
            "compressed": frame(payload, compressed=True),
            "short": frame(payload)[:-1] if payload else b"\x00\x00\x00\x00\x01",
            "long": frame(payload) + b"\x00\x01\x02",
            "twice": frame(payload) * 2,
            "prefix": b"\x00\x00",
            "empty": b"",
        }[framing]
        headers: list[tuple[str, str]] = []
        if content_type is not None:
            headers.append(("content-type", content_type))
        if te is not None:
            headers.append(("te", te))
        incomplete = framing in ("short", "prefix", "empty")
        if incomplete:
            timeout = "20m"  # the server waits for the rest of the message until then
        if timeout is not None:
            headers.append(("grpc-timeout", timeout))
        if encoding is not None:
            headers.append(("grpc-encoding", encoding))
        headers += chosen["extra"]
        compliant = te == "trailers" and (content_type or "").startswith("application/grpc")
        return GrpcInput(
            f"raw http/2 ({framing}): {kind}",
            payload,
            None,
            RawH2(tuple(headers), body, compliant),
        )

    return build()
