"""Prometheus metrics for torchheal processes.

The instrumented code keeps plain counters and :class:`~torchheal.metrics.stats.Histogram`
objects (no lock, no ``prometheus_client`` on the hot path); collectors (``lighthouse.py``,
``trainer.py``) turn them into metric families when ``/metrics`` is scraped.
"""

from torchheal.metrics.stats import Histogram

__all__ = ["Histogram"]
