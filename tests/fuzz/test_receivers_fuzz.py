"""Hostile checkpoint streams through the real receivers, end to end.

A hostile server process feeds ``HTTPTransport.recv_checkpoint``; a hostile sender process
feeds ``PGTransport.recv_checkpoint`` over a real Gloo group, receiving in place into a
template; ``decode_bytes`` decodes into a template in memory. Each must refuse what the
decoder refuses with ``CheckpointError`` (never another exception, never a partial state) and
load what it loads; a refused transfer must leave every template tensor untouched: in-place
receive writes only verified bytes.
"""

from __future__ import annotations

import pytest

from tests.fuzz.receiver_targets import all_targets
from tests.fuzz.runner import assert_clean, fuzz

TARGETS = all_targets()
# A PG transfer needs a fresh two-process Gloo group (~0.2 s): fewer generated inputs.
SHARE = {"checkpoint PG receiver (in place)": 0.2}


@pytest.mark.parametrize("name", list(TARGETS))
def test_receiver_refuses_hostile_checkpoints(name: str, examples: int) -> None:
    target = TARGETS[name]()
    try:
        tally = fuzz(target, int(examples * SHARE.get(name, 1.0)), strict=True, probe_every=50)
    finally:
        target.close()
    assert_clean(tally)
