"""Every HTTP endpoint (checkpoint server, lighthouse dashboard, parameter server), fuzzed.

Raw requests with hostile methods, targets (path traversal plain and encoded, NUL, 70 KB),
versions, tokens, headers and bodies, some cut short: every refusal is a 4xx with a message
(or the standard 501/505 for an unknown method or version), no server thread dies, a refused
request changes nothing (no kill, no session, the served checkpoint unchanged), and a normal
request succeeds afterwards.
"""

from __future__ import annotations

import pytest

from tests.fuzz.http_targets import all_targets
from tests.fuzz.runner import assert_clean, fuzz

TARGETS = all_targets()


@pytest.mark.parametrize("name", list(TARGETS))
def test_endpoint_survives_hostile_requests(name: str, examples: int) -> None:
    target = TARGETS[name]()
    try:
        tally = fuzz(target, 2 * examples, strict=True, probe_every=50)
    finally:
        target.close()
    assert_clean(tally)
