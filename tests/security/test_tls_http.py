"""TLS on gRPC and HTTP, the checkpoint transport's token, /metrics, the token file and the CLI.

TLS is made by the test's own throwaway CA (``pki.py``): clients that trust it get through,
plain clients and clients trusting another authority do not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from tests.security.conftest import TOKEN
from tests.security.pki import Pki
from torchheal._base.security import SecurityEnv, job_token
from torchheal._wire import methods
from torchheal._wire import torchft_pb2 as pb
from torchheal.checkpointing import HTTPTransport
from torchheal.checkpointing.transport import CheckpointError
from torchheal.coordination import LighthouseClient, LighthouseServer, ManagerServer
from torchheal.coordination.lighthouse.dashboard import DashboardServer, LighthouseRecorder
from torchheal.coordination.rpc.channels import UnaryCaller, connect
from torchheal.coordination.rpc.tls import client_ssl_context
from torchheal.coordination.types import QuorumAsk

TIMEOUT = timedelta(seconds=10)


def test_tls_on_the_lighthouse_and_the_manager_server(job_env: Any, pki: Pki) -> None:
    job_env(tls=True)
    lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1)
    try:
        assert lighthouse.direct_port() == 0  # the plain TCP lane stays closed under TLS
        addr = f"127.0.0.1:{lighthouse.port()}"
        server = ManagerServer(
            "g0", f"http://{addr}", "127.0.0.1", "127.0.0.1:0", "s:1", 1,
            timedelta(milliseconds=100), TIMEOUT,
        )  # fmt: skip
        try:
            assert server._link is not None and not server._link.direct  # the gRPC stream
            result = server.quorum_in_process(QuorumAsk(0, 0, "m", False, False, 0, TIMEOUT))
            assert result.replica_world_size == 1
        finally:
            server.shutdown()
        client = LighthouseClient(addr, TIMEOUT)
        try:
            assert not client.direct
            client.heartbeat("g1")
        finally:
            client.close()
        assert "g1" in lighthouse.status()["heartbeats"]

        # A plain client, or one trusting another authority, never gets a call through.
        request = pb.LighthouseHeartbeatRequest(replica_id="plain")
        for security in (
            SecurityEnv(token=TOKEN),
            SecurityEnv(token=TOKEN, tls_ca=str(pki.other_ca)),
        ):
            with pytest.raises(RuntimeError, match="failed to connect"):
                connect(addr, timedelta(seconds=1), security=security)
        with grpc.insecure_channel(addr) as channel:
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary(methods.LIGHTHOUSE_HEARTBEAT.path)(
                    request.SerializeToString(), timeout=2
                )
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # TLS without the token is still refused.
        channel = connect(addr, TIMEOUT, security=SecurityEnv(tls_ca=str(pki.ca)))
        with pytest.raises(RuntimeError, match="Unauthenticated"):
            UnaryCaller(channel, methods.LIGHTHOUSE_HEARTBEAT, "lh")(request, 5)
        channel.close()
        assert "plain" not in lighthouse.status()["heartbeats"]
    finally:
        lighthouse.shutdown()


def test_checkpoint_transport_takes_the_job_token(job_env: Any) -> None:
    job_env()  # TORCHHEAL_TOKEN only: the transport reads it as its token
    src = HTTPTransport(TIMEOUT, num_chunks=0)
    try:
        src.send_checkpoint([1], 3, {"w": torch.arange(4.0)}, TIMEOUT)
        for token in ("", "wrong"):
            dst = HTTPTransport(TIMEOUT, num_chunks=0, token=token)
            with pytest.raises(CheckpointError, match="401"):
                dst.recv_checkpoint(0, src.metadata(), 3)
            dst.shutdown()
        dst = HTTPTransport(TIMEOUT, num_chunks=2)
        assert torch.equal(dst.recv_checkpoint(0, src.metadata(), 3)["w"], torch.arange(4.0))
        dst.shutdown()
    finally:
        src.shutdown()


@pytest.mark.parametrize("served", [f"{TOKEN}\n", f"{TOKEN} "], ids=["newline", "blank"])
def test_checkpoint_token_with_surrounding_white_space_heals(
    job_env: Any, monkeypatch: pytest.MonkeyPatch, served: str
) -> None:
    # A secret mounted from a file ends in a newline; white space is not part of the token, on
    # either end, so healers holding the same secret written any of these ways all heal.
    job_env(token=None)
    monkeypatch.setenv("TORCHHEAL_CHECKPOINT_TOKEN", served)
    src = HTTPTransport(TIMEOUT, num_chunks=0)
    try:
        src.send_checkpoint([1], 3, {"w": torch.arange(4.0)}, TIMEOUT)
        for held in (served, f"\t{TOKEN}\n", TOKEN):
            monkeypatch.setenv("TORCHHEAL_CHECKPOINT_TOKEN", held)
            dst = HTTPTransport(TIMEOUT, num_chunks=2)
            try:
                got = dst.recv_checkpoint(0, src.metadata(), 3)
                assert torch.equal(got["w"], torch.arange(4.0)), repr(held)
            finally:
                dst.shutdown()
        dst = HTTPTransport(TIMEOUT, num_chunks=0, token=f"{TOKEN}x")
        with pytest.raises(CheckpointError, match="401"):
            dst.recv_checkpoint(0, src.metadata(), 3)
        dst.shutdown()
    finally:
        src.shutdown()


@pytest.mark.parametrize("inner", ["\n", "\x07", "\x7f", " "])
def test_checkpoint_token_with_a_control_character_is_refused_at_start_up(
    job_env: Any, monkeypatch: pytest.MonkeyPatch, inner: str
) -> None:
    job_env(token=None)
    monkeypatch.setenv("TORCHHEAL_CHECKPOINT_TOKEN", f"{TOKEN[:4]}{inner}{TOKEN[4:]}")
    with pytest.raises(ValueError, match=r"TORCHHEAL_CHECKPOINT_TOKEN.*printable ASCII"):
        HTTPTransport(TIMEOUT, num_chunks=0)


def test_checkpoint_transport_over_https(job_env: Any, pki: Pki) -> None:
    job_env(tls=True)
    src = HTTPTransport(TIMEOUT, num_chunks=0)
    try:
        assert src.metadata().startswith("https://")
        state = {"w": torch.randn(1000), "step": 3}
        src.send_checkpoint([1], 3, state, TIMEOUT)
        for chunks in (0, 3):
            dst = HTTPTransport(TIMEOUT, num_chunks=chunks)
            got = dst.recv_checkpoint(0, src.metadata(), 3)
            assert torch.equal(got["w"], state["w"]) and got["step"] == 3
            dst.shutdown()
        # A client trusting another authority refuses the server; plain HTTP gets nothing.
        job_env(tls=True, ca=pki.other_ca)
        dst = HTTPTransport(TIMEOUT, num_chunks=0)
        with pytest.raises(CheckpointError, match="CERTIFICATE_VERIFY_FAILED"):
            dst.recv_checkpoint(0, src.metadata(), 3)
        dst.shutdown()
        job_env()
        plain = HTTPTransport(TIMEOUT, num_chunks=0)
        with pytest.raises(CheckpointError, match="https but this transport speaks http"):
            plain.recv_checkpoint(0, src.metadata(), 3)
        url = src.metadata().replace("https://", "http://", 1)
        with pytest.raises(CheckpointError):
            plain.recv_checkpoint(0, url, 3)
        plain.shutdown()
    finally:
        src.shutdown()


def _get(url: str, headers: dict[str, str], context: Any = None) -> int:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code


def test_dashboard_metrics_token_is_opt_in_and_https(job_env: Any, pki: Pki) -> None:
    job_env(tls=True)
    security = SecurityEnv.from_env()
    from torchheal.coordination.rpc.tls import server_ssl_context

    lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1)
    recorder = LighthouseRecorder()
    open_dash = DashboardServer(lighthouse, recorder, host="127.0.0.1", port=0, token=TOKEN)
    guarded = DashboardServer(
        lighthouse,
        recorder,
        host="127.0.0.1",
        port=0,
        token=TOKEN,
        metrics_auth=True,
        ssl_context=server_ssl_context(security, "dashboard"),
    )
    try:
        assert _get(f"http://127.0.0.1:{open_dash.port}/metrics", {}) == 200  # the default
        url = f"https://127.0.0.1:{guarded.port}/metrics"
        context = client_ssl_context(security)
        assert _get(url, {}, context) == 401
        assert _get(url, {"Authorization": "Bearer wrong"}, context) == 401
        assert _get(url, {"Authorization": f"Bearer {TOKEN}"}, context) == 200
    finally:
        guarded.shutdown()
        open_dash.shutdown()
        lighthouse.shutdown()


def test_token_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert job_token({"TORCHHEAL_TOKEN_FILE": str(path)}) == TOKEN
    assert job_token({}) is None
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"TORCHHEAL_TOKEN_FILE.*empty"):
        job_token({"TORCHHEAL_TOKEN_FILE": str(path)})
    with pytest.raises(ValueError, match="cannot read"):
        job_token({"TORCHHEAL_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="not both"):
        job_token({"TORCHHEAL_TOKEN_FILE": str(path), "TORCHHEAL_TOKEN": "x"})
    with pytest.raises(ValueError, match="printable ASCII"):
        job_token({"TORCHHEAL_TOKEN": "two words"})
    with pytest.raises(ValueError, match="together"):
        SecurityEnv.from_env({"TORCHHEAL_TLS_CERT": str(path)})
    # The checkpoint transport's older name still wins for the transport.
    from torchheal._base.security import checkpoint_token

    env = {"TORCHHEAL_TOKEN": "job", "TORCHHEAL_CHECKPOINT_TOKEN": "old"}
    assert checkpoint_token(env) == "old"
    assert checkpoint_token({"TORCHHEAL_TOKEN": "job"}) == "job"


def test_security_flags_apply_to_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A command's flags reach its settings and its children's environment, never its own.
    from torchheal._base.security import SecurityFlags

    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    monkeypatch.setenv("TORCHHEAL_TOKEN", "old")
    monkeypatch.delenv("TORCHHEAL_TOKEN_FILE", raising=False)
    env = SecurityFlags(token_file=str(path)).environment()
    assert "TORCHHEAL_TOKEN" not in env and env["TORCHHEAL_TOKEN_FILE"] == str(path)
    assert SecurityEnv.from_env(env).token == TOKEN
    assert os.environ["TORCHHEAL_TOKEN"] == "old" and "TORCHHEAL_TOKEN_FILE" not in os.environ
    assert SecurityFlags().environment({"A": "1"}) == {"A": "1"}


def test_lighthouse_cli_with_a_token_file(
    job_env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_env(token=None)
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchheal.cli.lighthouse", "--min_replicas", "1",
         "--bind", "127.0.0.1:0", "--token-file", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving on" in line, line
        port = int(line.rstrip().rsplit(":", 1)[1])
        assert TOKEN not in " ".join(proc.args)  # only the path is on the command line
        addr = f"127.0.0.1:{port}"
        request = pb.LighthouseHeartbeatRequest(replica_id="g0")
        for security in (SecurityEnv(), SecurityEnv(token="wrong")):
            channel = connect(addr, TIMEOUT, security=security)
            with pytest.raises(RuntimeError, match="Unauthenticated"):
                UnaryCaller(channel, methods.LIGHTHOUSE_HEARTBEAT, "lh")(request, 5)
            channel.close()
        client = LighthouseClient(addr, TIMEOUT)  # reads nothing: refused
        try:
            with pytest.raises(RuntimeError, match="Unauthenticated"):
                client.heartbeat("g0")
        finally:
            client.close()
        monkeypatch.setenv("TORCHHEAL_TOKEN_FILE", str(path))
        client = LighthouseClient(addr, TIMEOUT)
        try:
            assert client.direct
            client.heartbeat("g0")
        finally:
            client.close()
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
