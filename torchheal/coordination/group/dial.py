"""Reaching a lighthouse: its addresses, the first of them that answers, and a failed call.

Several lighthouses (a highly available job, docs/lighthouse_ha.md): the address may list them,
comma-separated (``split_addresses``); :func:`connect_first` connects to the first that answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta

import grpc
import grpc.aio

from torchheal._base.security import SecurityEnv
from torchheal.coordination.rpc.addresses import parse_address
from torchheal.coordination.rpc.channels import aio_connect

__all__ = ["LinkError", "connect_first", "split_addresses"]


def split_addresses(addr: str) -> list[str]:
    """The lighthouse addresses in ``addr``, e.g. ``http://a:29510,http://b:29510``.

    ``ValueError`` for no address, or a malformed one.
    """
    addresses = [a.strip() for a in addr.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"no lighthouse address in {addr!r}")
    for a in addresses:
        parse_address(a)
    return addresses


async def connect_first(
    addresses: Sequence[str], connect_timeout: timedelta | float, security: SecurityEnv
) -> tuple[grpc.aio.Channel, str]:
    """A channel to the first of ``addresses`` that answers within ``connect_timeout``.

    All are tried at once: a standby does not listen, so trying each in turn would cost a whole
    timeout per standby. ``RuntimeError`` if none answered.
    """
    if len(addresses) == 1:
        return await aio_connect(addresses[0], connect_timeout, security), addresses[0]
    tasks = {asyncio.ensure_future(aio_connect(a, connect_timeout, security)): a for a in addresses}
    pending = set(tasks)
    errors = []
    chosen: tuple[grpc.aio.Channel, str] | None = None
    while pending and chosen is None:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            error = task.exception()
            if error is not None:
                errors.append(str(error))
            elif chosen is None:
                chosen = task.result(), tasks[task]
            else:
                await task.result().close()  # a second one answered in the same turn
    for task in pending:
        task.cancel()
    if chosen is None:
        raise RuntimeError(f"no lighthouse of {list(addresses)} could be reached: {errors}")
    return chosen


class LinkError(Exception):
    """A lighthouse request failed; carries the gRPC status the caller should see.

    Args:
        code: the status.
        details: what went wrong.
        local: our own timer gave up (no status came back from the lighthouse).
    """

    def __init__(self, code: grpc.StatusCode, details: str, local: bool = False) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.local = local
