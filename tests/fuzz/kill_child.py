"""A manager server alone in a process, for fuzzing ``Kill`` (which ends the process).

Run as ``python -m tests.fuzz.kill_child LIGHTHOUSE``: prints ``port N`` once serving, then
serves until its stdin closes (the parent went away or is done) or a ``Kill`` ends it.
"""

from __future__ import annotations

import logging
import sys
from datetime import timedelta

from torchheal.coordination import ManagerServer


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    server = ManagerServer(
        replica_id="fuzz:kill",
        lighthouse_addr=sys.argv[1],
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:1",
        world_size=1,
        heartbeat_interval=timedelta(seconds=1),
        connect_timeout=timedelta(seconds=10),
    )
    print(f"port {server.port()}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.shutdown()


if __name__ == "__main__":
    main()
