"""Generated HTTP/1.x requests, sent as raw bytes over a socket, and how to read the answer.

A request is assembled from parts each endpoint supplies (its paths and query values) and
hostile parts common to all: methods (unknown, lowercase, with NUL), targets (path traversal
plain and percent-encoded, NUL, 70 KB, raw UTF-8, absolute-form, ``*``), versions, the
``Authorization`` header (right token, wrong, huge, non-UTF-8, duplicated, another scheme),
``Origin``, ``Content-Length`` and ``Transfer-Encoding`` that lie, header lines without a colon
or folded, 150 headers, a 70 KB header, and bodies. Some requests are cut short, some are plain
garbage; those are followed by end-of-stream so the server sees the whole input.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from tests.fuzz.runner import ACCEPTED, REJECTED, UNCLEAR, Outcome

STANDARD_METHODS = {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"}
METHODS = ["GET"] * 6 + ["HEAD", "POST", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE"]
METHODS += ["CONNECT", "get", "XYZ", "G\x00T", "GET /x", ""]
VERSIONS = ["HTTP/1.1"] * 6 + ["HTTP/1.0", "HTTP/2.0", "HTTP/9.9", "HTTP/1.1x", "http/1.1", ""]
TRAVERSALS = [
    "/../../../../etc/passwd",
    "/static/../../../../etc/passwd",
    "/static/..%2f..%2f..%2fetc%2fpasswd",
    "/static/%2e%2e/%2e%2e/etc/passwd",
    "/static/....//....//etc/passwd",
    "/static/%00",
    "/static/app.js%00.png",
    "/static/\\..\\..\\etc\\passwd",
    "/%2e%2e/",
    "//etc/passwd",
    "/static/" + "a" * 5000,
    "/" + "a" * 70_000,
    "*",
    "http://evil.example/",
    "",
    "/\u00e9\U0001f642",
    "/%ff%fe",
    "/a b",
]


@dataclass(frozen=True, repr=False)
class HttpInput:
    """One raw request.

    Args:
        kind: which family made it, for reports.
        raw: the bytes sent.
        method: the method as sent (decides whether the answer has a body).
        complete: the request is whole (else the sender half-closes after it).
    """

    kind: str
    raw: bytes
    method: str
    complete: bool

    def __repr__(self) -> str:
        shown = self.raw if len(self.raw) <= 300 else self.raw[:300] + b"..."
        return f"HttpInput({self.kind}, {len(self.raw)}B {shown!r})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # hypothesis would print every field (megabytes) otherwise


def _enc(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def auth_headers(token: str | None) -> st.SearchStrategy[list[bytes]]:
    """``Authorization`` variants: missing, wrong, huge, another scheme, not UTF-8..."""
    right = f"Authorization: Bearer {token or 'x'}".encode()
    return st.sampled_from(
        [
            [],
            [b"Authorization: Bearer wrong"],
            [b"Authorization: Bearer " + b"x" * 10_000],
            [right.replace(b"Bearer", b"bearer")],
            [right.replace(b"Bearer", b"BEARER")],
            [right + b" "],
            [b"Authorization: Basic dXNlcjpwYXNz"],
            [b"Authorization: Bearer \xff\xfe"],
            [right + b"\xff"],
            [b"Authorization: \xc3\x28"],
            [b"Authorization: Bearer"],
            [b"Authorization: "],
            [right, b"Authorization: Bearer wrong"],
            [right + b"\x00"],
        ]
    )


HOSTILE_HEADER_LINES = [
    b"Origin: http://evil.example",
    b"Origin: http://[",
    b"Origin: http://[::1",
    b"Origin: null",
    b"Origin: \xff\xfe",
    b"Origin: http://127.0.0.1:1:2:3",
    b"Content-Length: -1",
    b"Content-Length: abc",
    b"Content-Length: 99999999999999999999999",
    b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip, chunked",
    b"Transfer-Encoding: identity",
    b"Accept: application/openmetrics-text; version=1.0.0; charset=utf-8",
    b"Accept: application/openmetrics-text;;;=",
    b"Accept: \xff",
    b"Connection: Upgrade",
    b"Upgrade: websocket",
    b"Expect: 100-continue",
    b"NoColonHere",
    b" folded: continuation",
    b"Bad Name: x",
    b"X-Big: " + b"x" * 70_000,
    b"X-Nul: a\x00b",
    b"Host: ",
    b"Host: \xff",
    b"Cookie: \xff\xfe=\x00",
]
# One or two odd header lines, or 150 of them.
HOSTILE_HEADERS = st.one_of(
    st.lists(st.sampled_from(HOSTILE_HEADER_LINES), min_size=1, max_size=2),
    st.just([b"X-Many-%d: y" % i for i in range(150)]),
)
BODIES = st.sampled_from([b"", b"", b"", b"hello", b"0\r\n\r\n", b"zz\r\nbad\r\n", b"\x00" * 1000])


def http_inputs(
    routes: st.SearchStrategy[tuple[str, str]], token: str | None
) -> st.SearchStrategy[HttpInput]:
    """Requests built around an endpoint's ``routes``: (method, target with query) pairs.

    Four shapes: a clean request to one of the routes (whose targets already carry the
    endpoint's hostile values), the same with exactly one hostile part (method, target,
    version, authorization, header, body or a cut), a request where every part is drawn from
    the hostile sets, and plain garbage.

    Args:
        routes: the endpoint's own routes and their variants (valid and not).
        token: the server's token, so clean requests carry the right one.
    """
    targets = st.sampled_from(TRAVERSALS)
    methods = st.sampled_from(METHODS)
    versions = st.sampled_from(VERSIONS)
    auths = auth_headers(token)
    right = [f"Authorization: Bearer {token}".encode()] if token else []
    shapes = st.sampled_from(["clean"] * 7 + ["one"] * 9 + ["any"] * 3 + ["garbage"])
    parts = st.sampled_from(["method", "target", "version", "auth", "header", "body", "cut"])
    cuts = st.floats(0, 0.999)

    @st.composite
    def build(draw: st.DrawFn) -> HttpInput:
        shape = draw(shapes)
        if shape == "garbage":
            return HttpInput("garbage", draw(st.binary(max_size=200)), "GET", False)
        method, target = draw(routes)
        version, auth, extra, body, cut = "HTTP/1.1", right, [], b"", None
        hostile = {draw(parts)} if shape == "one" else set()
        if shape == "any":
            hostile = {"method", "target", "version", "auth", "header", "body", "cut"}
        if "method" in hostile:
            method = draw(methods)
        if "target" in hostile and draw(st.booleans()):
            target = draw(targets)
        if "version" in hostile:
            version = draw(versions)
        if "auth" in hostile:
            auth = draw(auths)
        if "header" in hostile:
            extra = draw(HOSTILE_HEADERS)
        if "body" in hostile:
            body = draw(BODIES)
        if "cut" in hostile and (shape == "one" or draw(st.booleans())):
            cut = draw(cuts)
        line = _enc(" ".join(p for p in (method, target, version) if p))
        headers = [b"Host: 127.0.0.1", *auth, *extra]
        if body and not any(h.lower().startswith(b"content-length") for h in headers):
            headers.append(b"Content-Length: %d" % len(body))
        raw = line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body
        kind = shape if shape != "one" else f"one hostile {next(iter(hostile))}"
        if cut is not None:
            return HttpInput(f"{kind}, cut", raw[: int(len(raw) * cut)], method, False)
        return HttpInput(kind, raw, method, True)

    return build()


def send_http(port: int, value: HttpInput, timeout: float = 10.0) -> Outcome:
    """Send one raw request to 127.0.0.1:``port`` and classify the answer.

    Accepted: 1xx-3xx. Rejected: 4xx with a message; 501 for a method that is not a standard
    one and 505 for an HTTP version the server does not speak (each with a message); a request
    that was cut short or is not HTTP may also be closed without an answer. Anything else
    (other 5xx, an empty error, a dropped complete request, no answer) is unclear.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(value.raw)
            if not value.complete:
                sock.shutdown(socket.SHUT_WR)
            sent = True
        except OSError:  # the server closed early (e.g. a line too long): read its answer
            sent = False
        try:
            status, body = read_response(sock, value.method == "HEAD")
        except TimeoutError:
            return Outcome(UNCLEAR, f"no answer within {timeout}s")
    if status is None:
        line = value.raw.split(b"\r\n", 1)[0].split()
        if body and len(line) == 2 and line[0] == b"GET":
            # "GET /path" without a version is HTTP/0.9: the answer is a bare body.
            return Outcome(ACCEPTED, "HTTP/0.9 answer (no status line)")
        if body:
            return Outcome(UNCLEAR, f"answered without a status line: {body[:100]!r}")
        if not value.complete or not sent:
            return Outcome(REJECTED, "closed without an answer (incomplete request)")
        return Outcome(UNCLEAR, "closed without an answer")
    what = f"{status} {body[:100]!r}"
    if status < 400:
        return Outcome(ACCEPTED, f"{status}")
    if not body and value.method != "HEAD":
        return Outcome(UNCLEAR, f"{status} without a message")
    if 400 <= status < 500:
        return Outcome(REJECTED, what)
    if status == 501 and value.method not in STANDARD_METHODS:
        return Outcome(REJECTED, what)
    if status == 505:
        return Outcome(REJECTED, what)
    return Outcome(UNCLEAR, what)


def read_response(sock: socket.socket, head_only: bool) -> tuple[int | None, bytes]:
    """Read one HTTP/1.x answer leniently: (status, body), or (None, bytes) without a status.

    Lenient because a fuzzed request may get an odd but meaningful answer (an ``HTTP/2.0``
    status line echoing the request's version, an HTTP/0.9 bare body).

    Raises:
        TimeoutError: the server neither answered nor closed in time.
    """
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            chunk = _recv(sock)
            if not chunk:
                break
            data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        line = head.split(b"\r\n", 1)[0].split(b" ", 2)
        if not sep or len(line) < 2 or not line[0].startswith(b"HTTP/") or not line[1].isdigit():
            return None, data
        status = int(line[1])
        if not 100 <= status < 200:
            break
        data = body  # an interim answer (100 Continue): the real one follows
    headers = {}
    for raw in head.split(b"\r\n")[1:]:
        name, _, val = raw.partition(b":")
        headers[name.strip().lower()] = val.strip()
    if head_only or status in (204, 304):
        return status, body
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        while not body.endswith(b"0\r\n\r\n"):
            chunk = _recv(sock)
            if not chunk:
                break
            body += chunk
        return status, body
    length = headers.get(b"content-length")
    if length is not None and length.isdigit():
        while len(body) < int(length):
            chunk = _recv(sock)
            if not chunk:
                break
            body += chunk
        return status, body
    while chunk := _recv(sock):  # until the server closes
        body += chunk
    return status, body


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except TimeoutError:
        raise
    except OSError:  # reset by the peer: what arrived before is the answer
        return b""
