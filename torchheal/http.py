"""An IPv6 threading HTTP server (public path ``torchheal.http``, as the reference's).

Binding ``::`` with an IPv6 socket accepts IPv4 clients too on dual-stack hosts, so one server
class serves both. A deep listen backlog absorbs bursts of healing peers connecting at once.
"""

from __future__ import annotations

import socket
from http.server import ThreadingHTTPServer

__all__ = ["_IPv6HTTPServer"]


class _IPv6HTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` on an IPv6 socket with a 1024-connection backlog."""

    address_family = socket.AF_INET6
    request_queue_size = 1024
