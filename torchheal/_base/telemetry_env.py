"""What a process exports about itself: trainer metrics, log records, OpenTelemetry, dashboards.

* :class:`TelemetryEnv` - a trainer's metrics port, the job id of its log records, OpenTelemetry.
* :func:`nccl_debug_pipe_prefix` - where NCCL's flight recorder listens for dump requests.
* :func:`dashboard_port` - the lighthouse dashboard's port.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torchheal._base.env import OFF, parse_port, source

#: Port of a replica group's Prometheus ``/metrics`` (group rank 0 only; unset: off).
METRICS_PORT_ENV: str = "TORCHHEAL_METRICS_PORT"
#: Address the trainer's ``/metrics`` listens on (default: every address).
METRICS_HOST_ENV: str = "TORCHHEAL_METRICS_HOST"
#: The job's name in structured log records, as the reference reads it.
JOB_ID_ENV: str = "JOB_ID"
#: The reference's OpenTelemetry switch and resource-attribute file (torchheal names first).
USE_OTEL_ENVS: tuple[str, str] = ("TORCHHEAL_USE_OTEL", "TORCHFT_USE_OTEL")
OTEL_RESOURCE_ATTRIBUTES_JSON_ENVS: tuple[str, str] = (
    "TORCHHEAL_OTEL_RESOURCE_ATTRIBUTES_JSON",
    "TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON",
)


def job_id(environ: Mapping[str, str] | None = None) -> str:
    """The job's name in structured log records (``JOB_ID``, default ``"unknown"``)."""
    return source(environ).get(JOB_ID_ENV, "unknown")


@dataclass(frozen=True)
class TelemetryEnv:
    """What a trainer exports about itself: metrics port, job id, OpenTelemetry.

    Attributes:
        metrics_port: serve ``/metrics`` on group rank 0 at this port (0: any free port);
            None: no metrics server.
        metrics_host: the address it listens on ("" : every one).
        job_id: put in every structured log record.
        use_otel: export the structured log records over OpenTelemetry. Unlike the reference
            (on for anything but ``false``), any of :data:`~torchheal._base.env.OFF` is off.
        otel_resource_attributes_json: a JSON file ``{logger name: {attribute: value}}`` of
            OpenTelemetry resource attributes, or None.
    """

    metrics_port: int | None = None
    metrics_host: str = ""
    job_id: str = "unknown"
    use_otel: bool = False
    otel_resource_attributes_json: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TelemetryEnv:
        """Reads and validates the variables."""
        env = source(environ)
        port: int | None = None
        raw = env.get(METRICS_PORT_ENV, "").strip()
        if raw:
            port = parse_port(METRICS_PORT_ENV, raw)
        use_otel = next((env[n] for n in USE_OTEL_ENVS if n in env), "false")
        attributes = next(
            (env[n] for n in OTEL_RESOURCE_ATTRIBUTES_JSON_ENVS if env.get(n, "").strip()), None
        )
        return cls(
            metrics_port=port,
            metrics_host=env.get(METRICS_HOST_ENV, "").strip(),
            job_id=job_id(env),
            use_otel=use_otel.strip().lower() not in OFF,
            otel_resource_attributes_json=attributes,
        )


#: torch's variable naming the prefix of NCCL's flight-recorder pipes.
NCCL_DEBUG_PIPE_ENV: str = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"


def nccl_debug_pipe_prefix(environ: Mapping[str, str] | None = None) -> str:
    """The prefix of NCCL's flight-recorder pipes (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``), or ""."""
    return source(environ).get(NCCL_DEBUG_PIPE_ENV, "")


#: The lighthouse dashboard's HTTP port (``torchheal lighthouse --dashboard_port``).
DASHBOARD_PORT_ENV: str = "TORCHHEAL_DASHBOARD_PORT"


def dashboard_port(environ: Mapping[str, str] | None = None) -> int | None:
    """The dashboard port from ``TORCHHEAL_DASHBOARD_PORT`` (0: any free port), or None."""
    value = source(environ).get(DASHBOARD_PORT_ENV, "").strip()
    if not value:
        return None
    return parse_port(DASHBOARD_PORT_ENV, value)
