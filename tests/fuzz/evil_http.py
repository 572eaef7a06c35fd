"""A hostile checkpoint server in its own process: serves whatever bytes the fuzzer left for it.

Run as ``python -m tests.fuzz.evil_http DIR``; prints ``port N`` once listening and serves until
its stdin closes. ``GET .../full`` answers ``DIR/full``, ``.../metadata`` ``DIR/metadata`` and
``.../{i}`` ``DIR/chunk{i}``, all with status 200. With ``DIR/mode`` reading ``close`` the
answer has no ``Content-Length`` and ends when the connection closes.
"""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def main() -> None:
    root = Path(sys.argv[1])

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            key = self.path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
            name = key if key in ("full", "metadata") else f"chunk{key}"
            path = root / name
            body = path.read_bytes() if path.is_file() else b""
            close = (root / "mode").is_file() and (root / "mode").read_text() == "close"
            self.send_response(200)
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            else:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except OSError:  # the receiver gave up: fine, that is its right
                self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.handle_error = lambda request, address: None  # type: ignore[method-assign]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"port {server.server_address[1]}", flush=True)
    sys.stdin.read()
    server.shutdown()


if __name__ == "__main__":
    main()
