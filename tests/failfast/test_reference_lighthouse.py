"""On the reference's lighthouse, which sends no notices, a frozen store host costs its peers a
store timeout, never the rest of the job.

``test_freeze.py``'s third scenario, on the reference's own (Rust) lighthouse: three torchheal
groups train at ``min_replicas=1``; group 0 stops itself (SIGSTOP) as a killed group rejoins,
right after the quorum of all three is answered, and group 0, the first up-to-date group, hosts
that quorum's rendezvous store. A frozen host's kernel accepts connections and nothing answers
them. c10d's store client waits for its first answer with no timeout, and this lighthouse tells
nobody that group 0 is gone, so no notice abandons the others' builds: only the connection's own
timeout may end them (``process_group/store.py``). The workers' timeouts are
``STORE_TIMEOUT_S``; the survivor must then commit in a quorum without the frozen host (the
lighthouse dropped it when its heartbeat expired). Before the cut, the builds waited until the
host woke: never, in this test. Woken, the host rejoins and heals; all end bit-identical and
equal to the replayed history.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.failfast.job import Job
from tests.failfast.test_freeze import GROUPS, freeze_the_store_host_at_a_rejoin
from tests.interop.helpers import loopback
from tests.reference import import_reference

reference = import_reference("torchft.coordination")

pytestmark = [pytest.mark.slow, pytest.mark.interop, pytest.mark.timeout(300)]

#: The workers' store and collective timeout: the frozen host costs the others about this.
STORE_TIMEOUT_S = 8.0
#: From the host's freeze to the survivor's commit without it: the builds' store timeout (their
#: connection to the frozen host is cut just after it), a failed step, a quorum and a build.
WITHOUT_HOST_BOUND_S = 3 * STORE_TIMEOUT_S
#: From the host's wake to every group's third full commit: the woken host's own build waits
#: for peers that left until its timeout.
WOKEN_BOUND_S = 3 * STORE_TIMEOUT_S


def test_a_frozen_store_host_costs_its_peers_one_store_timeout_on_the_reference_lighthouse(
    tmp_path: Path,
) -> None:
    lh = reference.LighthouseServer(
        "127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=100,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=2_000,
    )
    try:
        job = Job(tmp_path, loopback(lh), GROUPS, timeout_s=STORE_TIMEOUT_S)
        try:
            freeze_the_store_host_at_a_rejoin(job, WITHOUT_HOST_BOUND_S, WOKEN_BOUND_S)
        finally:
            job.close()
    finally:
        lh.shutdown()
