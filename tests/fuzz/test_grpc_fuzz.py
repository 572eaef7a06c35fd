"""Every RPC of the lighthouse and of the manager server, fed generated hostile inputs.

The reference's unary RPCs, and torchheal's streams (the lighthouse's ``Session``, the manager
server's ``Watch``; ``tests/fuzz/stream_targets.py``).

Each endpoint gets its known hostile values (every field of a plausible request set to each,
every grpc-timeout form) and generated inputs (malformed bytes, hostile values, raw HTTP/2):
no server thread or process dies, every refusal is a status with a message, a refused request
changes no state, and a normal request succeeds afterwards (see ``tests/fuzz/runner.py``).
"""

from __future__ import annotations

import pytest

from tests.fuzz import grpc_targets, stream_targets
from tests.fuzz.runner import assert_clean, fuzz

TARGETS = {**grpc_targets.all_targets(), **stream_targets.all_targets()}


@pytest.mark.parametrize("name", list(TARGETS))
def test_rpc_survives_hostile_inputs(name: str, examples: int) -> None:
    target = TARGETS[name]()
    try:
        tally = fuzz(target, examples, strict=True, probe_every=50)
    finally:
        target.close()
    assert_clean(tally)
