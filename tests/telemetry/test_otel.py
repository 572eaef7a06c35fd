"""OpenTelemetry export of the structured records: to a real OTLP/HTTP endpoint (a stand-in for
the collector, which is outside torchheal), off by default, and a clear error without the extra.

Each case runs in a child process: OpenTelemetry's logger provider is process-global.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# The test extra installs the otel extra; without it this import fails loudly, as it should.
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2

ROOT = Path(__file__).resolve().parents[2]

EMIT = textwrap.dedent(
    """
    from torchheal import otel
    from torchheal.coordination.types import QuorumResult
    from torchheal.manager.telemetry import Telemetry
    from torchheal.process_group import ProcessGroupGloo

    t = Telemetry("rg_1", "rg_1:0b5e", group_rank=0)
    t.quorum(QuorumResult(quorum_id=5, max_step=10, replica_world_size=2), -1, 2, 0.01)
    t.committed(10, 5, True)
    ProcessGroupGloo().abort()  # the process group writes torchft_errors
    otel.shutdown()
    print("emitted", flush=True)
    """
)


class _Collector(BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        type(self).bodies.append(self.rfile.read(length))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _run(env: dict[str, str], script: str = EMIT, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if "OTEL" not in k}
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _value(any_value) -> object:
    field = any_value.WhichOneof("value")
    return getattr(any_value, field) if field else None


def test_records_reach_an_otlp_endpoint_with_their_fields_and_resource(tmp_path: Path) -> None:
    _Collector.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    attributes = tmp_path / "resource.json"
    attributes.write_text(
        json.dumps({"torchft_commits": {"service.name": "trainer", "cluster": "c7"}})
    )
    try:
        done = _run(
            {
                "TORCHFT_USE_OTEL": "true",
                "JOB_ID": "job-42",
                "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON": str(attributes),
                "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": (
                    f"http://127.0.0.1:{server.server_address[1]}/v1/logs"
                ),
            }
        )
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0 and "emitted" in done.stdout, done.stderr[-3000:]

    records: dict[str, list[dict]] = {}
    resources: dict[str, dict] = {}
    for body in _Collector.bodies:
        request = logs_service_pb2.ExportLogsServiceRequest.FromString(body)
        for resource_logs in request.resource_logs:
            resource = {a.key: _value(a.value) for a in resource_logs.resource.attributes}
            for scope in resource_logs.scope_logs:
                for record in scope.log_records:
                    fields = {a.key: _value(a.value) for a in record.attributes}
                    name = scope.scope.name
                    records.setdefault(name, []).append(fields)
                    resources[name] = resource
    assert set(records) == {"torchft_quorums", "torchft_commits", "torchft_errors"}, records
    (quorum,) = records["torchft_quorums"]
    assert {k: quorum[k] for k in ("job_id", "replica_id", "rank", "quorum_id", "step")} == {
        "job_id": "job-42",
        "replica_id": "rg_1",
        "rank": 0,
        "quorum_id": 5,
        "step": 10,
    }
    (commit,) = records["torchft_commits"]
    assert commit["commit_result"] is True and commit["step"] == 10 and commit["quorum_id"] == 5
    assert commit["job_id"] == "job-42" and commit["replica_id"] == "rg_1" and commit["rank"] == 0
    (error,) = records["torchft_errors"]
    assert error["error"] == "process_group_abort" and error["job_id"] == "job-42"
    # The file's entry for a logger becomes that logger's resource.
    assert resources["torchft_commits"]["cluster"] == "c7"
    assert resources["torchft_commits"]["service.name"] == "trainer"
    assert "cluster" not in resources["torchft_quorums"]


# One process tries every value in turn (a value that switched export on fails its own turn:
# the sys.modules check cannot be passed once opentelemetry was imported).
OFF_VALUES = [None, "false", "False", "0", "off"]
CHECK_OFF = textwrap.dedent(
    """
    import json, logging, os, sys
    from torchheal import otel
    from torchheal.manager.telemetry import Telemetry
    for value in json.loads(sys.argv[1]):
        os.environ.pop("TORCHFT_USE_OTEL", None)
        if value is not None:
            os.environ["TORCHFT_USE_OTEL"] = value
        Telemetry("rg", "rg:1", group_rank=0)
        otel.setup_logger("torchft_commits")
        assert not logging.getLogger("torchft_commits").handlers, value
        assert not any(m.startswith("opentelemetry") for m in sys.modules), f"{value}: imported otel"
        print(f"off: {value}", flush=True)
    """
)


def test_export_is_off_by_default_and_when_switched_off() -> None:
    done = _run({}, CHECK_OFF, json.dumps(OFF_VALUES))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [f"off: {v}" for v in OFF_VALUES], done.stdout


# The extra is not installed: every opentelemetry import fails, as in a plain install.
WITHOUT_OTEL = textwrap.dedent(
    """
    import sys

    class NoOtel:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ImportError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoOtel())
    import torchheal.otel  # import-safe without the extra
    from torchheal.manager.telemetry import Telemetry
    try:
        Telemetry("rg", "rg:1", group_rank=0)
    except ImportError as e:
        print("ERROR:", e, flush=True)
    """
)


def test_switched_on_without_the_extra_says_how_to_install_it() -> None:
    done = _run({"TORCHHEAL_USE_OTEL": "1"}, WITHOUT_OTEL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ERROR: OpenTelemetry export is switched on" in done.stdout
    assert "pip install 'torchheal[otel]'" in done.stdout
