"""Prometheus metrics for torchheal processes.

The instrumented code keeps plain counters and :class:`~torchheal.metrics.stats.Histogram`
objects (an increment is an integer add, no lock, no ``prometheus_client`` on the hot path); a
collector turns them into metric families when ``/metrics`` is scraped. Each served process gets
its own registry, so two servers in one process never clash.

* ``stats.py`` — plain counters' building blocks (no dependencies).
* ``exposition.py`` — registries, text rendering, helpers for collectors (prometheus-client).
* ``lighthouse.py`` — the lighthouse's metrics (``torchheal_lighthouse_*``).
* ``trainer.py`` — a trainer's metrics (``torchheal_trainer_*``).
"""

from torchheal.metrics.stats import Histogram

__all__ = ["Histogram"]
