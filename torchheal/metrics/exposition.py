"""Prometheus plumbing: per-server registries, the text exposition, collector helpers.

``prometheus_client`` is a dependency of torchheal, but it is imported here only, so the
coordination and training code never pay for it unless metrics are served.
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
    """A fresh registry holding ``collectors`` (and the process's own metrics).

    A registry per served process role, instead of prometheus_client's global one, keeps two
    servers in one process (tests, the demo) from clashing.

    Args:
        collectors: objects with a ``collect()`` method yielding metric families.
        process: also export ``process_*`` (CPU, memory, file descriptors) and
            ``python_*`` (GC, version) metrics.

    Returns:
        A ``prometheus_client.CollectorRegistry``.
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
    """The registry's current values in the format the scraper asked for.

    Args:
        registry: a registry from :func:`new_registry`.
        accept: the request's ``Accept`` header (OpenMetrics when it asks for it).

    Returns:
        ``(body, content type)``.
    """
    from prometheus_client import exposition

    encoder, content_type = exposition.choose_encoder(accept or "")
    return encoder(registry), content_type


def histogram_family(
    name: str, documentation: str, snapshot: HistogramSnapshot, labels: dict[str, str] | None = None
) -> Any:
    """A histogram metric family from a :class:`~torchheal.metrics.stats.Histogram` snapshot.

    Args:
        name: metric name without the ``_bucket``/``_sum``/``_count`` suffixes.
        documentation: the HELP text.
        snapshot: the values.
        labels: constant labels of the series.
    """
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
