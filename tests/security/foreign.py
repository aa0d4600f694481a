"""A foreign HTTP server: not SGLang, answers every request the same way and records it.

The SSRF attacks point the admin API at it (200 `{}`, an HTML page, a redirect, a lookalike
with the wrong role) and then check that it was only ever probed, never sent traffic.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class Foreign:
    def __init__(self, body: bytes = b"{}", content_type: str = "application/json",
                 status: int = 200, location: str | None = None, host: str = "127.0.0.1"):
        self.hits: list[tuple[str, str]] = []
        foreign = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self) -> None:
                foreign.hits.append((self.command, self.path))
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                self.send_response(status)
                if location:
                    self.send_header("location", location)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = answer

            def log_message(self, *args) -> None:
                pass

        self.server = (_V6Server if ":" in host else ThreadingHTTPServer)((host, 0), Handler)
        self.port = self.server.server_address[1]
        self.host = host
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def posts(self) -> list[str]:
        return [path for method, path in self.hits if method != "GET"]

    def __enter__(self) -> Foreign:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
