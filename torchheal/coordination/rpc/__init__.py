"""gRPC plumbing shared by the lighthouse, the manager server and their clients, one idea a file.

* ``addresses.py`` - address and timeout-header parsing (no I/O).
* ``errors.py`` - statuses raised by handlers, exceptions raised to callers.
* ``auth.py`` - the job token: checked by servers (``UNAUTHENTICATED``), sent by clients.
* ``tls.py`` - TLS credentials for gRPC and ``ssl`` contexts for HTTP.
* ``channels.py`` - client channels and unary calls.
* ``server.py`` - method handlers and the event-loop server thread.
* ``in_process.py`` - calling a handler from the server's own process.

Imports flow down that list.
"""
