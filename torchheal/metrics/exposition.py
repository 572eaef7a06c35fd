"""Prometheus plumbing: per-server registries, the text exposition, collector helpers.

``prometheus_client`` is imported here only, so code that serves no metrics never pays for it.
"""

from __future__ import annotations

from typing import Any

from torchheal.metrics.stats import HistogramSnapshot

__all__ = ["histogram_family", "new_registry", "render"]


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as e:  # pragma: no cover - it is a declared dependency
        raise ImportError(
            "torchheal metrics need the 'prometheus-client' package: pip install prometheus-client"
        ) from e
    return prometheus_client


def new_registry(*collectors: Any, process: bool = True) -> Any:
    """A fresh ``CollectorRegistry`` holding ``collectors`` (and, with ``process``, the
    ``process_*`` and ``python_*`` metrics).

    One per served role, not the global one, so two servers in one process never clash.
    """
    prom = _prometheus()
    registry = prom.CollectorRegistry(auto_describe=True)
    if process:
        prom.ProcessCollector(registry=registry)
        prom.PlatformCollector(registry=registry)
        prom.GCCollector(registry=registry)
    for collector in collectors:
        registry.register(collector)
    return registry


def render(registry: Any, accept: str | None = None) -> tuple[bytes, str]:
    """``(body, content type)`` of the registry's values in the format the request's
    ``Accept`` header asks for."""
    from prometheus_client import exposition

    encoder, content_type = exposition.choose_encoder(accept or "")
    return encoder(registry), content_type


def histogram_family(
    name: str, documentation: str, snapshot: HistogramSnapshot, labels: dict[str, str] | None = None
) -> Any:
    """A histogram metric family (``name`` without its suffixes) from a
    :class:`~torchheal.metrics.stats.Histogram` snapshot."""
    from prometheus_client.core import HistogramMetricFamily

    labels = labels or {}
    family = HistogramMetricFamily(name, documentation, labels=list(labels))
    buckets: list[tuple[str, float]] = [
        (_format_bound(b), c) for b, c in zip(snapshot.bounds, snapshot.cumulative, strict=False)
    ]
    buckets.append(("+Inf", snapshot.cumulative[-1]))
    family.add_metric(list(labels.values()), buckets, snapshot.sum)
    return family


def _format_bound(bound: float) -> str:
    return repr(float(bound))
