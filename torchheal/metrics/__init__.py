"""Prometheus metrics for torchheal processes.

The instrumented code (the lighthouse's observer today, the trainers' managers later) keeps
plain counters and :class:`~torchheal.metrics.stats.Histogram` objects: an increment is an
integer add, with no lock and no import of ``prometheus_client`` on the hot path. A collector
reads them when ``/metrics`` is scraped and turns them into Prometheus metric families
(``exposition.py``). Each served process gets its own registry, so two servers in one process
(tests, the demo) never share or clash over metrics.

* ``stats.py`` — plain counters' building blocks (no dependencies).
* ``exposition.py`` — registries, text rendering, helpers for collectors (prometheus-client).
* ``lighthouse.py`` — the lighthouse's metrics (``torchheal_lighthouse_*``).

Adding trainer metrics: keep a stats object in the manager, write a collector next to
``lighthouse.py`` and serve its registry on the port the trainer's flag names (for example with
``prometheus_client.start_http_server(port, registry=registry)``).
"""

from torchheal.metrics.stats import Histogram

__all__ = ["Histogram"]
