"""A TCP proxy that can stall: one replica group's path to the lighthouse, for ``chaos.py``.

Each group reaches the lighthouse through a proxy of its own, listening on a loopback address
of its own (``127.0.0.N``) on the lighthouse's ports (the gRPC port and the direct session
lane's, whose port the lighthouse announces and the group dials on the host it already knows).
:meth:`StallingProxy.stall` models a network partition of that path: the proxy stops moving
bytes both ways but keeps every connection open (no FIN, no RST), so the lighthouse hears
nothing until the group's heartbeat expires, and the group's calls hang. :meth:`resume` moves
the held bytes on, in order, as TCP would after a partition heals; a side that closed meanwhile
(the lighthouse ending an expired session) is then closed on the other side too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

__all__ = ["StallingProxy"]

CHUNK = 64 * 1024


class StallingProxy:
    """Forwards ``host:port`` to ``target_host:port`` for each port, until stalled.

    Args:
        host: the address to listen on (a loopback address of this group's own).
        target_host: the lighthouse's host.
        ports: the ports to forward (the same number on both sides).
    """

    def __init__(self, host: str, target_host: str, ports: Sequence[int]) -> None:
        self.host = host
        self._target = target_host
        self._loop = asyncio.new_event_loop()
        self._open = asyncio.Event()
        self._servers: list[asyncio.base_events.Server] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._call(self._start(list(ports)))

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _start(self, ports: list[int]) -> None:
        self._open.set()
        for port in ports:

            async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter, port=port) -> None:
                await self._pair(r, w, port)

            self._servers.append(await asyncio.start_server(serve, self.host, port))

    async def _pair(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, port: int) -> None:
        self._writers.add(w)
        try:
            await self._open.wait()  # a connection made during a stall waits, unanswered
            ur, uw = await asyncio.open_connection(self._target, port)
        except OSError:
            w.close()
            self._writers.discard(w)
            return
        self._writers.add(uw)
        await asyncio.gather(self._pump(r, uw), self._pump(ur, w), return_exceptions=True)
        for writer in (w, uw):
            writer.close()
            self._writers.discard(writer)

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await r.read(CHUNK)
                await self._open.wait()  # stalled: hold what was read, read nothing more
                if not data:
                    break
                w.write(data)
                await w.drain()
        except OSError:
            pass  # a side reset (a killed group): the pair ends
        w.close()

    def stall(self) -> None:
        """Stops moving bytes (both ways, every connection, new ones included)."""
        self._loop.call_soon_threadsafe(self._open.clear)

    def resume(self) -> None:
        """Moves bytes again, the held ones first."""
        self._loop.call_soon_threadsafe(self._open.set)

    def close(self) -> None:
        """Stops listening and closes every connection."""

        async def stop() -> None:
            for server in self._servers:
                server.close()
            for writer in list(self._writers):
                writer.close()
            # End every connection's tasks here, so none is destroyed pending with the loop.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._call(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
