"""An IPv6 threading HTTP server (public path ``torchheal.http``, as the reference's).

``::`` accepts IPv4 clients too on dual-stack hosts; a deep backlog absorbs bursts of healing peers.
"""

from __future__ import annotations

import socket
from http.server import ThreadingHTTPServer

__all__ = ["_IPv6HTTPServer"]


class _IPv6HTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` on an IPv6 socket with a 1024-connection backlog."""

    address_family = socket.AF_INET6
    request_queue_size = 1024
