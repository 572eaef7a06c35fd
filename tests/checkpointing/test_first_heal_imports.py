"""A process that holds no DTensor serves and receives its first checkpoint without importing
``torch.distributed.tensor``: that import took about 1.1 s here (sympy), and a survivor pays
for its first heal served in the middle of its step. Before, the first ``stage`` imported it to
ask whether a tensor was a DTensor, and a Manager test with a 1 s timeout failed when run alone.

A fresh interpreter runs the transfer (this one may have imported DTensor already); a DTensor's
own transfer is ``test_dtensor.py``'s.
"""

from __future__ import annotations

import subprocess
import sys

TRANSFER = """
import sys
from datetime import timedelta
import torch
from torchheal.checkpointing import HTTPTransport

timeout = timedelta(seconds=30)
src = HTTPTransport(timeout, 0, hostname="localhost")
dst = HTTPTransport(timeout, 0, hostname="localhost")
state = {"model": {"w": torch.randn(64, 64)}, "step": 3}
mine = {"model": {"w": torch.zeros(64, 64)}}
src.send_checkpoint([1], 3, state, timeout)
out = dst.recv_checkpoint(0, src.metadata(), 3, timeout, into=mine)
assert torch.equal(out["model"]["w"], state["model"]["w"]) and out["step"] == 3
src.shutdown()
dst.shutdown()
print("imported" if "torch.distributed.tensor" in sys.modules else "not imported")
"""


def test_a_checkpoint_without_dtensors_does_not_import_them() -> None:
    done = subprocess.run(
        [sys.executable, "-c", TRANSFER], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "not imported", done.stdout
