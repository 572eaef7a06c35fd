"""Address parsing, timeouts, error mapping and the server thread of coordination.rpc."""

from __future__ import annotations

import socket
from datetime import timedelta

import grpc
import pytest

from torchheal._base.security import SecurityEnv
from torchheal._base.timeouts import to_seconds
from torchheal.coordination import LighthouseServer
from torchheal.coordination.rpc.addresses import format_target, parse_address, parse_grpc_timeout
from torchheal.coordination.rpc.channels import connect
from torchheal.coordination.rpc.errors import status_name


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("http://host:1", ("host", 1)),
        ("host:29510", ("host", 29510)),
        ("[::1]:3", ("::1", 3)),
        ("http://[::1]:4/", ("::1", 4)),
        ("[::]:0", ("::", 0)),
        ("127.0.0.1:65535", ("127.0.0.1", 65535)),
    ],
)
def test_parse_address_accepts(addr, expected):
    assert parse_address(addr) == expected


@pytest.mark.parametrize(
    ("addr", "message"),
    [
        ("host", "expected host:port"),
        ("::1:5", "brackets"),
        ("http://host:abc", "port must be"),
        ("host:70000", "port must be"),
        ("ftp://h:1", "unsupported scheme"),
        (":5", "missing host"),
        ("[::1]5", "expected [ipv6]:port"),
        ("", "expected host:port"),
    ],
)
def test_parse_address_rejects_with_clear_message(addr, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_address(addr)


def test_format_target_brackets_ipv6():
    assert format_target("::1", 5) == "[::1]:5"
    assert format_target("host", 5) == "host:5"
    assert format_target("[::1]", 5) == "[::1]:5"  # already bracketed: left alone


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("100m", 0.1), ("5S", 5.0), ("1H", 3600.0), ("2M", 120.0), ("7u", 7e-6), ("9n", 9e-9)],
)
def test_parse_grpc_timeout(header, seconds):
    assert parse_grpc_timeout(header) == pytest.approx(seconds)


@pytest.mark.parametrize("header", ["", "123456789S", "5x", "S", "-1S"])
def test_parse_grpc_timeout_rejects(header):
    with pytest.raises(ValueError, match="invalid timeout"):
        parse_grpc_timeout(header)


def test_to_seconds():
    assert to_seconds(timedelta(milliseconds=250)) == 0.25
    assert to_seconds(2) == 2.0
    with pytest.raises(ValueError, match="negative"):
        to_seconds(timedelta(seconds=-1))
    with pytest.raises(TypeError, match="timedelta"):
        to_seconds("5s")


def test_status_name_matches_reference_spelling():
    assert status_name(grpc.StatusCode.INVALID_ARGUMENT) == "InvalidArgument"
    assert status_name(grpc.StatusCode.DEADLINE_EXCEEDED) == "DeadlineExceeded"


def test_connect_to_nothing_raises_runtime_error():
    # A port that was free a moment ago: nothing listens there.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match="failed to connect"):
        connect(f"127.0.0.1:{port}", timedelta(milliseconds=300), SecurityEnv())


def test_binding_a_taken_port_raises_runtime_error(make_lighthouse):
    first = make_lighthouse()
    with pytest.raises(RuntimeError, match="bind"):
        LighthouseServer(f"127.0.0.1:{first.port()}", min_replicas=1)


def test_bad_bind_address_raises_value_error():
    with pytest.raises(ValueError, match="port"):
        LighthouseServer("127.0.0.1:notaport", min_replicas=1)


def test_bad_options_raise_value_error():
    with pytest.raises(ValueError, match="min_replicas"):
        LighthouseServer("127.0.0.1:0", min_replicas=0)
    with pytest.raises(ValueError, match="heartbeat_timeout_ms"):
        LighthouseServer("127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=-5)


def test_shutdown_is_idempotent(make_lighthouse):
    server = make_lighthouse()
    server.shutdown()
    server.shutdown()
