"""OpenTelemetry export of torchheal's structured log records (the reference's ``torchft.otel``).

With ``TORCHHEAL_USE_OTEL`` (or ``TORCHFT_USE_OTEL``) on, :func:`setup_logger` sends a logger's
records (``torchft_quorums``, ``torchft_commits``, ``torchft_errors``) to the console and to an
OTLP/HTTP collector, with resource attributes from the JSON file named by
``TORCHHEAL_OTEL_RESOURCE_ATTRIBUTES_JSON``. OpenTelemetry is an optional extra, imported only then.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from torchheal._base.telemetry_env import OTEL_RESOURCE_ATTRIBUTES_JSON_ENVS, TelemetryEnv

__all__ = ["TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON", "TeeLogExporter", "setup_logger", "shutdown"]

#: The reference's name of the resource-attribute file's variable (``TORCHHEAL_...`` wins).
TORCHFT_OTEL_RESOURCE_ATTRIBUTES_JSON = OTEL_RESOURCE_ATTRIBUTES_JSON_ENVS[1]

#: Seconds an OTLP export may take, as the reference sets it.
EXPORT_TIMEOUT_S = 5

# logger name -> its LoggerProvider; guarded so two threads never set up one logger twice.
_LOGGER_PROVIDER: dict[str, Any] = {}
_LOCK = threading.Lock()

_MISSING = (
    "OpenTelemetry export is switched on ({variable}) but the OpenTelemetry packages are not "
    "installed: pip install 'torchheal[otel]' (opentelemetry-sdk and "
    "opentelemetry-exporter-otlp-proto-http), or unset {variable}"
)


def _otel() -> dict[str, Any]:
    """The OpenTelemetry classes this module uses (ImportError with the fix when missing)."""
    try:
        from opentelemetry._logs import set_logger_provider
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
        from opentelemetry.sdk._logs import export as sdk_export
        from opentelemetry.sdk.resources import Resource
    except ImportError as e:
        raise ImportError(_MISSING.format(variable="TORCHHEAL_USE_OTEL/TORCHFT_USE_OTEL")) from e
    # The SDK renamed its exporter classes (LogExporter -> LogRecordExporter); take either.
    console = getattr(sdk_export, "ConsoleLogRecordExporter", None) or sdk_export.ConsoleLogExporter
    result = getattr(sdk_export, "LogRecordExportResult", None) or sdk_export.LogExportResult
    return {
        "set_logger_provider": set_logger_provider,
        "OTLPLogExporter": OTLPLogExporter,
        "LoggerProvider": LoggerProvider,
        "LoggingHandler": LoggingHandler,
        "BatchLogRecordProcessor": sdk_export.BatchLogRecordProcessor,
        "Console": console,
        "ExportResult": result,
        "Resource": Resource,
    }


class TeeLogExporter:
    """Hands each batch of log records to several exporters (console and OTLP)."""

    def __init__(self, exporters: Sequence[Any]) -> None:
        self._exporters = list(exporters)

    def export(self, batch: Sequence[Any]) -> Any:
        """Exports ``batch`` with every exporter (a failing one does not stop the others);
        SUCCESS when all succeeded."""
        result = _otel()["ExportResult"]
        ok = True
        for exporter in self._exporters:
            try:
                ok = exporter.export(batch) == result.SUCCESS and ok
            except Exception:
                logging.getLogger(__name__).exception("OpenTelemetry log export failed")
                ok = False
        return result.SUCCESS if ok else result.FAILURE

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Flushes every exporter that can be flushed, within ``timeout_millis`` in all."""
        deadline = time.monotonic() + timeout_millis / 1000.0
        ok = True
        for exporter in self._exporters:
            flush = getattr(exporter, "force_flush", None)
            if flush is not None:
                left = max(0, int((deadline - time.monotonic()) * 1000))
                ok = bool(flush(left)) and ok
        return ok

    def shutdown(self) -> None:
        """Shuts every exporter down."""
        for exporter in self._exporters:
            exporter.shutdown()


def _resource_attributes(path: str | None, name: str) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path) as f:
            attributes = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read OpenTelemetry resource attributes from {path}: {e}") from e
    if not isinstance(attributes, dict):
        raise ValueError(f"{path}: expected a JSON object {{logger name: {{attribute: value}}}}")
    mine = attributes.get(name, {})
    if not isinstance(mine, dict):
        raise ValueError(f"{path}: the entry for {name!r} must be a JSON object")
    return mine


def setup_logger(name: str, env: TelemetryEnv | None = None) -> None:
    """Exports the records of logger ``name`` over OpenTelemetry, when switched on (once).

    Args:
        name: the logger (``torchft_quorums``, ``torchft_commits``, ``torchft_errors``, ...).
        env: the parsed environment (default: read now).

    Raises:
        ImportError: export is on but OpenTelemetry is not installed.
        ValueError: the resource-attribute file cannot be read.
    """
    env = env or TelemetryEnv.from_env()
    if not env.use_otel:
        return
    with _LOCK:
        if name in _LOGGER_PROVIDER:
            return
        otel = _otel()
        attributes = _resource_attributes(env.otel_resource_attributes_json, name)
        provider = otel["LoggerProvider"](resource=otel["Resource"].create(attributes=attributes))
        otel["set_logger_provider"](provider)
        exporter = TeeLogExporter(
            [otel["Console"](), otel["OTLPLogExporter"](timeout=EXPORT_TIMEOUT_S)]
        )
        provider.add_log_record_processor(otel["BatchLogRecordProcessor"](exporter))
        logger = logging.getLogger(name)
        logger.addHandler(otel["LoggingHandler"](level=logging.NOTSET, logger_provider=provider))
        # The records are INFO; the root's default (WARNING) would drop them.
        if logger.level == logging.NOTSET or logger.level > logging.INFO:
            logger.setLevel(logging.INFO)
        _LOGGER_PROVIDER[name] = provider


def shutdown() -> None:
    """Flushes and shuts down every provider :func:`setup_logger` created."""
    with _LOCK:
        providers = list(_LOGGER_PROVIDER.values())
    for provider in providers:
        provider.shutdown()
