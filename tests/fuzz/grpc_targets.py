"""The gRPC endpoints under fuzzing: every RPC of the lighthouse and of the manager server.

Each target runs a real server on loopback (port 0) and sends inputs from
:mod:`tests.fuzz.grpc_inputs` through the ``grpc`` client or as raw HTTP/2. Answers are
classified by :func:`classify`; a refused input must leave the server's state as it was.

``Kill`` ends the manager's process by design, so its server runs in a child process
(:mod:`tests.fuzz.kill_child`): malformed requests must be refused with the child alive; a
well-formed one must be answered and the child must exit with code 1, after which a standby
child (already started) takes over.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

from tests.fuzz import h2call
from tests.fuzz.grpc_inputs import (
    BAD_HEADER_TIMEOUTS,
    HEADER_TIMEOUTS,
    TIMEOUTS,
    GrpcInput,
    RawH2,
    corpus,
    grpc_inputs,
    malformed_only,
    parses,
    plausible,
    well_formed,
)
from tests.fuzz.runner import ACCEPTED, REJECTED, UNCLEAR, Outcome
from torchheal._wire import methods
from torchheal._wire import session_pb2 as spb
from torchheal._wire import torchft_pb2 as pb
from torchheal._wire.methods import Method
from torchheal.coordination import LighthouseClient, LighthouseServer, ManagerClient, ManagerServer
from torchheal.coordination.lighthouse.session import MAX_REPLICA_ID_BYTES
from torchheal.coordination.rpc.addresses import parse_grpc_timeout

REPO = Path(__file__).resolve().parents[2]
# Longest wait for any one answer; longer means the server did not answer.
BOUND_S = 10.0
# A deadline this short may pass before a well-formed request is served.
SHORT_DEADLINE_S = 0.25
INT64_MAX = (1 << 63) - 1
# Statuses that say clearly what was wrong (with a message); the first three refuse a request
# before it does anything, so the server's state must not change.
CLEAR = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}
STATE_CHECKED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
}
# INTERNAL answers gRPC itself gives for a malformed call, before any handler runs.
TRANSPORT_INTERNAL = ("Error parsing", "ompression", "grpc-encoding", "grpc-timeout")
T = timedelta(seconds=5)


def deadline_of(value: GrpcInput) -> float | None:
    """The deadline the server sees for an input, in seconds (None: no deadline)."""
    if value.raw is None:
        return value.timeout
    for k, v in value.raw.headers:
        if k == "grpc-timeout":
            try:
                return parse_grpc_timeout(v)
            except ValueError:
                return None
    return None


def classify(
    method: Method, value: GrpcInput, code: grpc.StatusCode, details: str, body: bytes
) -> Outcome:
    """Classify one answer (see :mod:`tests.fuzz.runner` for the kinds)."""
    what = f"{code.name}: {details}"
    if code == grpc.StatusCode.OK:
        try:
            method.response.FromString(body)
        except Exception as e:
            return Outcome(UNCLEAR, f"OK with an unparsable {method.response.__name__}: {e}")
        return Outcome(ACCEPTED, "OK")
    if not details:
        return Outcome(UNCLEAR, f"{code.name} without a message")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        deadline = deadline_of(value)
        if deadline is not None and deadline > SHORT_DEADLINE_S:
            return Outcome(UNCLEAR, f"{what} (the client allowed {deadline:g}s)")
        return Outcome(REJECTED, what, state_checked=False)
    if code in CLEAR:
        return Outcome(REJECTED, what, state_checked=code in STATE_CHECKED)
    if code == grpc.StatusCode.INTERNAL and any(t in details for t in TRANSPORT_INTERNAL):
        return Outcome(REJECTED, what)
    return Outcome(UNCLEAR, what)


class GrpcTarget:
    """One RPC of a live server.

    Args:
        name: the endpoint's name in the table.
        method: the RPC.
        port: the server's port on 127.0.0.1.
        strategy: the inputs.
    """

    def __init__(self, name: str, method: Method, port: int, strategy: st.SearchStrategy[Any]):
        self.name = name
        self.method = method
        self._strategy = strategy
        self._connect(port)

    def _connect(self, port: int) -> None:
        self.port = port
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self._call = self._channel.unary_unary(self.method.path)  # bytes in, bytes out

    def inputs(self) -> st.SearchStrategy[Any]:
        return self._strategy

    def known(self) -> list[GrpcInput]:
        """Each known hostile value in a plausible request (:func:`corpus`), then a plausible
        request under each ``grpc-timeout`` value and each malformed header."""
        out = [GrpcInput(kind, payload, 5.0) for kind, payload in corpus(self.method.request)]
        payload = plausible(self.method.request).SerializeToString()
        # Two malformed values are enough here: gRPC takes ~0.1-0.5 s to refuse each.
        for timeout in [*HEADER_TIMEOUTS, *BAD_HEADER_TIMEOUTS[:2]]:
            headers = [("content-type", "application/grpc"), ("te", "trailers")]
            if timeout is not None:
                headers.append(("grpc-timeout", timeout))
            raw = RawH2(tuple(headers), h2call.frame(payload), True)
            out.append(GrpcInput(f"raw http/2, grpc-timeout {timeout!r}", payload, None, raw))
        return out

    def impossible(self, request: Message) -> str | None:
        """Why a parsed request must be refused (values no honest client sends), or None."""
        return None

    def send(self, value: GrpcInput) -> Outcome:
        outcome = self._send(value)
        if outcome.kind == ACCEPTED:
            try:
                why = self.impossible(self.method.request.FromString(value.payload))
            except DecodeError:
                why = None  # odd framing around an unparsable payload (e.g. two messages)
            if why is not None:
                return Outcome(UNCLEAR, f"accepted an impossible request: {why}")
        return outcome

    def _send(self, value: GrpcInput) -> Outcome:
        if value.raw is not None:
            return self._send_raw(value)
        future = self._call.future(value.payload, timeout=value.timeout)
        try:
            body = future.result(timeout=BOUND_S)
        except grpc.FutureTimeoutError:
            future.cancel()
            return Outcome(UNCLEAR, f"no answer within {BOUND_S}s")
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._flush()
            return classify(self.method, value, e.code(), e.details() or "", b"")
        return classify(self.method, value, grpc.StatusCode.OK, "", body)

    def _flush(self) -> None:
        """Wait until a request the client gave up on has reached its handler.

        A call whose deadline passed on the client side may still be dispatched on the server
        afterwards, changing state during the next input. The server dispatches the calls of
        one connection in order, so once a later call on it is answered, the earlier one has
        run (up to its first wait).
        """
        try:
            self._call(b"\xff", timeout=BOUND_S)  # never parses: refused at once
        except grpc.RpcError:
            pass

    def _send_raw(self, value: GrpcInput) -> Outcome:
        assert value.raw is not None
        try:
            result = h2call.raw_call(
                ("127.0.0.1", self.port),
                self.method.path,
                list(value.raw.headers),
                value.raw.body,
                timeout=BOUND_S,
            )
        except TimeoutError:
            return Outcome(UNCLEAR, f"no answer within {BOUND_S}s")
        except ConnectionError as e:
            return Outcome(UNCLEAR, f"connection failed: {e}")
        if result.grpc_status is None:
            if not value.raw.compliant:
                # Not a gRPC request (no "te: trailers" or not a gRPC content type): gRPC
                # refuses it at the HTTP/2 level (a reset, or an HTTP error status).
                return Outcome(
                    REJECTED, f"refused by the gRPC transport (HTTP {result.http_status})"
                )
            return Outcome(
                UNCLEAR, f"no grpc-status (HTTP {result.http_status}, reset={result.reset})"
            )
        code = _code(result.grpc_status)
        if code == grpc.StatusCode.OK:
            # One framed message: 5-byte prefix and the response.
            body = result.body[5:] if len(result.body) >= 5 else b"\xff"
            return classify(self.method, value, code, "", body)
        return classify(self.method, value, code, result.grpc_message, b"")

    def close(self) -> None:
        self._channel.close()


def _code(value: int) -> grpc.StatusCode:
    for code in grpc.StatusCode:
        if code.value[0] == value:
            return code
    return grpc.StatusCode.UNKNOWN


def _thread_gone(server: Any, what: str) -> str | None:
    thread = server._server._thread  # the AioServerThread's loop thread
    return None if thread.is_alive() else f"the {what}'s event-loop thread died"


# --------------------------------------------------------------------------------------------
# Lighthouse


WAIT_CAP_S = 2.0  # the longest a valid lighthouse Quorum request is let wait


def _with_deadline(value: GrpcInput, cap_s: float) -> GrpcInput:
    """``value`` with its deadline capped at ``cap_s`` (whether sent by the client or raw)."""
    if value.raw is None:
        return GrpcInput(value.kind, value.payload, min(value.timeout or cap_s, cap_s))
    current = deadline_of(value)
    if current is not None and current <= cap_s:
        return value
    headers = [h for h in value.raw.headers if h[0] != "grpc-timeout"]
    headers.append(("grpc-timeout", f"{int(cap_s * 1000)}m"))
    return GrpcInput(
        value.kind, value.payload, None, RawH2(tuple(headers), value.raw.body, value.raw.compliant)
    )


class LighthouseQuorumTarget(GrpcTarget):
    """``LighthouseService/Quorum`` of a lighthouse that issues a quorum at once.

    A 3 ms heartbeat timeout, and a pause until the previous requester expired, let every
    accepted request form a quorum by itself, so each is answered instead of waiting for it.
    One request waits by design: ``shrink_only`` from a replica outside the last quorum
    (a quorum may only shrink); its deadline is capped at 20 ms, any other valid request's at
    2 s, and a valid request that waited until then counts as accepted (it was).
    """

    def __init__(self) -> None:
        self.server = LighthouseServer(
            "127.0.0.1:0",
            min_replicas=1,
            quorum_tick_ms=50,
            heartbeat_timeout_ms=self.HEARTBEAT_TIMEOUT_MS,
        )
        super().__init__(
            "lighthouse Quorum",
            methods.LIGHTHOUSE_QUORUM,
            self.server.port(),
            grpc_inputs(pb.LighthouseQuorumRequest),
        )
        self._client = LighthouseClient(f"127.0.0.1:{self.server.port()}", T)

    HEARTBEAT_TIMEOUT_MS = 3

    def impossible(self, request: Message) -> str | None:
        member = request.requester
        if not request.HasField("requester") or not member.replica_id:
            return "no requester id"
        if len(member.replica_id.encode()) > MAX_REPLICA_ID_BYTES:
            return "a replica id longer than a session may use"
        if member.step < 0 or member.commit_failures < 0:
            return "a negative step or commit_failures"
        return None

    def _let_earlier_requesters_expire(self) -> None:
        # A request waits for any requester still heartbeating: let them all expire first.
        expired = time.monotonic() - self.HEARTBEAT_TIMEOUT_MS / 1000.0
        with self.server._lock:
            last = max(self.server._state.heartbeats.values(), default=0.0)
        if last > expired:
            pause = threading.Event()  # never set: an interruptible pause
            pause.wait(last - expired + 1e-4)

    def send(self, value: GrpcInput) -> Outcome:
        self._let_earlier_requesters_expire()
        by_design = self._waits_by_design(value)
        try:
            request = pb.LighthouseQuorumRequest.FromString(value.payload)
            valid = self.impossible(request) is None
        except DecodeError:
            valid = False
        # A valid request waits until a quorum forms: at once here, unless the machine is so
        # loaded that its own 3 ms heartbeat expires before the lighthouse's next decision
        # (then it waits for ever, as a request alone in a lighthouse must). Bound that wait.
        cap_s = 0.02 if by_design else WAIT_CAP_S
        if valid:
            value = _with_deadline(value, cap_s)
        outcome = super().send(value)
        if valid and "DEADLINE" in outcome.detail:
            why = "a shrink_only newcomer" if by_design else "a request alone on a slow machine"
            return Outcome(ACCEPTED, f"waited for a quorum ({why}) until its deadline")
        return outcome

    def _waits_by_design(self, value: GrpcInput) -> bool:
        try:
            request = pb.LighthouseQuorumRequest.FromString(value.payload)
        except Exception:
            return False
        member = request.requester
        if not (request.HasField("requester") and member.replica_id and member.shrink_only):
            return False
        prev = self.server.status()["prev_quorum"]
        return prev is not None and member.replica_id not in {
            m["replica_id"] for m in prev["participants"]
        }

    def snapshot(self) -> Any:
        return _lighthouse_state(self.server)

    def alive(self) -> str | None:
        return _thread_gone(self.server, "lighthouse")

    def normal(self) -> str | None:
        self._let_earlier_requesters_expire()
        try:
            quorum = self._client.quorum("normal:replica", timeout=T, step=1)
        except Exception as e:
            return str(e)
        ids = [m.replica_id for m in quorum.participants]
        return None if "normal:replica" in ids else f"not in the quorum: {ids}"

    def close(self) -> None:
        super().close()
        self._client.close()
        self.server.shutdown()


class LighthouseHeartbeatTarget(GrpcTarget):
    """``LighthouseService/Heartbeat``."""

    def __init__(self) -> None:
        self.server = LighthouseServer("127.0.0.1:0", min_replicas=1)
        super().__init__(
            "lighthouse Heartbeat",
            methods.LIGHTHOUSE_HEARTBEAT,
            self.server.port(),
            grpc_inputs(pb.LighthouseHeartbeatRequest),
        )
        self._client = LighthouseClient(f"127.0.0.1:{self.server.port()}", T)

    def impossible(self, request: Message) -> str | None:
        if len(request.replica_id.encode()) > MAX_REPLICA_ID_BYTES:
            return "a replica id longer than a session may use"
        return None if request.replica_id else "no replica id"

    def snapshot(self) -> Any:
        return _lighthouse_state(self.server)

    def alive(self) -> str | None:
        return _thread_gone(self.server, "lighthouse")

    def normal(self) -> str | None:
        try:
            self._client.heartbeat("normal:replica", timeout=T)
        except Exception as e:
            return str(e)
        return None if "normal:replica" in self.server.status()["heartbeats"] else "not recorded"

    def close(self) -> None:
        super().close()
        self._client.close()
        self.server.shutdown()


class _LighthouseState:
    """What a refused request must not change: the quorum id, the waiting requests and every
    heartbeat's time, read exactly from the lighthouse's state under its lock."""

    def __init__(self, server: LighthouseServer) -> None:
        with server._lock:
            state = server._state
            self.quorum_id = state.quorum_id
            self.waiting = dict(state.participants)
            self.seen = dict(state.heartbeats)

    def __eq__(self, other: object) -> bool:
        """``before == after``: same quorum id and waiting requests, no heartbeat added or
        refreshed. Heartbeats may disappear: the lighthouse forgets those older than a minute
        on its own (the runner compares ``before != after``, so ``self`` is the earlier state).
        """
        if not isinstance(other, _LighthouseState):
            return NotImplemented
        return (
            (self.quorum_id, self.waiting) == (other.quorum_id, other.waiting)
            and other.seen.keys() <= self.seen.keys()
            and all(self.seen[k] == seen for k, seen in other.seen.items())
        )

    def __repr__(self) -> str:
        return f"quorum_id={self.quorum_id} waiting={len(self.waiting)} heartbeats={len(self.seen)}"


def _lighthouse_state(server: LighthouseServer) -> _LighthouseState:
    return _LighthouseState(server)


# --------------------------------------------------------------------------------------------
# Manager server


class _ManagerTarget(GrpcTarget):
    """An RPC of a manager server (world size 1) with its own lighthouse."""

    def __init__(self, name: str, method: Method, strategy: st.SearchStrategy[Any]) -> None:
        self.lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1)
        self.server = ManagerServer(
            replica_id="fuzz:manager",
            lighthouse_addr=f"127.0.0.1:{self.lighthouse.port()}",
            hostname="127.0.0.1",
            bind="127.0.0.1:0",
            store_addr="127.0.0.1:1",
            world_size=1,
            heartbeat_interval=timedelta(milliseconds=100),
            connect_timeout=T,
        )
        super().__init__(name, method, self.server.port(), strategy)
        self.client = ManagerClient(self.server.address(), T)
        self.step = 0

    def impossible(self, request: Message) -> str | None:
        if getattr(request, "group_rank", 0) != 0:  # world size 1
            return f"group_rank {request.group_rank}"
        if getattr(request, "step", 0) < 0 or getattr(request, "commit_failures", 0) < 0:
            return "a negative step or commit_failures"
        if getattr(request, "rank", 0) != 0:  # only rank 0 published metadata
            return f"metadata of rank {request.rank}"
        return None

    def snapshot(self) -> Any:
        return manager_state(self.server)

    def alive(self) -> str | None:
        return _thread_gone(self.server, "manager server") or _thread_gone(
            self.lighthouse, "lighthouse"
        )

    def close(self) -> None:
        super().close()
        self.client.close()
        self.server.shutdown()
        self.lighthouse.shutdown()


def manager_state(server: ManagerServer) -> tuple[Any, ...]:
    """The manager server's round, checkpoint metadata and vote, read on its loop."""

    async def read() -> tuple[Any, ...]:
        metadata = sorted((r, len(m), hash(m)) for r, m in server._checkpoint_metadata.items())
        vote = server._vote
        return (
            server._round.round_id,
            server._round.waiting,
            tuple(metadata),
            vote.step,
            vote.voted,
            vote.last_decision,
        )

    return server._server.submit(read()).result(BOUND_S)


class ManagerQuorumTarget(_ManagerTarget):
    """``ManagerService/Quorum``."""

    def __init__(self) -> None:
        super().__init__(
            "manager Quorum", methods.MANAGER_QUORUM, grpc_inputs(pb.ManagerQuorumRequest)
        )

    def normal(self) -> str | None:
        self.step += 1
        try:
            result = self.client._quorum(0, self.step, "normal", False, False, 0, T)
        except Exception as e:
            return str(e)
        return None if result.replica_ids == ["fuzz:manager"] else f"odd result {result}"


class ManagerCheckpointMetadataTarget(_ManagerTarget):
    """``ManagerService/CheckpointMetadata`` (rank 0 has published metadata)."""

    def __init__(self) -> None:
        super().__init__(
            "manager CheckpointMetadata",
            methods.MANAGER_CHECKPOINT_METADATA,
            grpc_inputs(pb.CheckpointMetadataRequest),
        )
        self.client._quorum(0, 1, "http://127.0.0.1:1/checkpoint/", False, False, 0, T)

    def normal(self) -> str | None:
        try:
            metadata = self.client._checkpoint_metadata(0, T)
        except Exception as e:
            return str(e)
        return None if metadata == "http://127.0.0.1:1/checkpoint/" else f"got {metadata!r}"


class ManagerShouldCommitTarget(_ManagerTarget):
    """``ManagerService/ShouldCommit`` (world size 1: each vote decides its step)."""

    def __init__(self) -> None:
        super().__init__(
            "manager ShouldCommit",
            methods.MANAGER_SHOULD_COMMIT,
            grpc_inputs(pb.ShouldCommitRequest),
        )

    def normal(self) -> str | None:
        last = manager_state(self.server)[-1]
        step = 0 if last is None else last.step + 1 if last.commit else last.step
        if step > INT64_MAX:
            # A vote settled the largest int64 step: no later step exists to vote on; the
            # only right answer to any vote is a clear refusal.
            try:
                self.client.should_commit(0, INT64_MAX, True, T)
            except RuntimeError as e:
                return None if "already decided" in str(e) else str(e)
            return "a vote after the largest step was accepted"
        try:
            decided = self.client.should_commit(0, step, True, T)
        except Exception as e:
            return str(e)
        return None if decided else "the only rank voted yes, yet the step did not commit"


# --------------------------------------------------------------------------------------------
# Kill: the manager server in a child process


class _Child:
    """A manager server in a child process (``python -m tests.fuzz.kill_child``)."""

    def __init__(self, lighthouse: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fuzz.kill_child", lighthouse],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()  # "port N" once serving
            if not line.startswith("port "):
                raise RuntimeError(f"kill child failed to start: {line!r}")
            self._port = int(line.split()[1])
        return self._port

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the child exits when its stdin closes
            if self.wait_exit(10) is None:
                self.proc.kill()
                self.proc.wait()


class ManagerKillTarget(GrpcTarget):
    """``ManagerService/Kill`` against a child process, with a standby child ready.

    Args:
        well_formed_every: one input in this many is a well-formed request (the others never
            parse): each one ends a child, so they are kept rare.
    """

    def __init__(self, well_formed_every: int = 40) -> None:
        self.lighthouse = LighthouseServer("127.0.0.1:0", min_replicas=1)
        self._lh_addr = f"127.0.0.1:{self.lighthouse.port()}"
        self.child = _Child(self._lh_addr)
        self.standby = _Child(self._lh_addr)
        self.kills = 0
        good = well_formed(pb.KillRequest).map(lambda p: GrpcInput(p[0], p[1], 5.0))
        bad = malformed_only(pb.KillRequest)
        which = st.sampled_from([True] + [False] * (well_formed_every - 1))
        strategy = st.tuples(which, good, bad).map(lambda w: w[1] if w[0] else w[2])
        super().__init__("manager Kill", methods.MANAGER_KILL, self.child.port, strategy)

    def send(self, value: GrpcInput) -> Outcome:
        outcome = super().send(value)
        if outcome.kind != ACCEPTED:
            return outcome
        # A Kill that was answered must end the process (exit code 1); then swap in the standby.
        code = self.child.wait_exit(BOUND_S)
        if code != 1:
            return Outcome(UNCLEAR, f"Kill answered OK but the process exit code is {code}")
        self.kills += 1
        self._swap()
        return outcome

    def known(self) -> list[GrpcInput]:
        """The known hostile requests, spoiled (a parsed Kill ends the process)."""
        return [
            GrpcInput(f"{kind} + truncated field", payload + b"\x0a\x05ab", 5.0)
            for kind, payload in corpus(pb.KillRequest)
        ]

    def _swap(self) -> None:
        self.close_channel()
        self.child, self.standby = self.standby, _Child(self._lh_addr)
        self._connect(self.child.port)

    def close_channel(self) -> None:
        self._channel.close()

    def snapshot(self) -> Any:
        return (self.child.proc.pid, self.child.proc.poll())

    def alive(self) -> str | None:
        code = self.child.proc.poll()
        return None if code is None else f"the manager process exited with code {code}"

    def normal(self) -> str | None:
        """A normal Kill: answered, and the process exits with code 1."""
        try:
            self._call(pb.KillRequest(msg="fuzz: normal kill").SerializeToString(), timeout=5)
        except grpc.RpcError as e:
            return f"{e.code().name}: {e.details()}"
        code = self.child.wait_exit(BOUND_S)
        if code != 1:
            return f"the process did not exit after Kill (exit code {code})"
        self.kills += 1
        self._swap()
        return None

    def close(self) -> None:
        self.close_channel()
        self.child.stop()
        self.standby.stop()
        self.lighthouse.shutdown()


class ManagerGaveUpTarget(_ManagerTarget):
    """``ManagerNotices/ReportGaveUp`` (passed on to the lighthouse, which ignores a quorum it
    did not issue last)."""

    def __init__(self) -> None:
        super().__init__("manager ReportGaveUp", methods.MANAGER_GAVE_UP, grpc_inputs(spb.GaveUp))

    def normal(self) -> str | None:
        try:
            self.client.gave_up(1, "normal", T)
        except Exception as e:
            return str(e)
        return None


def all_targets() -> dict[str, Any]:
    """Constructors of every gRPC target, by table name."""
    return {
        "lighthouse Quorum": LighthouseQuorumTarget,
        "lighthouse Heartbeat": LighthouseHeartbeatTarget,
        "manager Quorum": ManagerQuorumTarget,
        "manager CheckpointMetadata": ManagerCheckpointMetadataTarget,
        "manager ShouldCommit": ManagerShouldCommitTarget,
        "manager Kill": ManagerKillTarget,
        "manager ReportGaveUp": ManagerGaveUpTarget,
    }


__all__ = ["TIMEOUTS", "all_targets", "classify", "parses"]
