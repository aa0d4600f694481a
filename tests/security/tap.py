"""A wire tap: a TCP relay in front of one server that records every HTTP request through it.

The security tests must show what reached the SGLang servers (which `/abort_request` bodies,
which `x-request-id` headers, whether a foreign URL was ever sent a generation), and the
simulator does not log that. The gateway is given the tap's address instead of the server's;
the tap relays bytes both ways unchanged (streams, keep-alive and disconnects included) and
parses the gateway-to-server direction with httptools to keep (method, path, headers, body) of
each request. It runs its own event loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

import httptools

HOST = "127.0.0.1"


@dataclass
class Seen:
    """One request as the server received it."""

    method: str
    path: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    at: float = 0.0  # monotonic

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)


class _Recorder:
    """httptools callbacks of one connection's request direction."""

    def __init__(self, tap: WireTap) -> None:
        self.tap = tap
        self.current: Seen | None = None
        self.url = b""
        self.parser = httptools.HttpRequestParser(self)

    def on_message_begin(self) -> None:
        self.current = Seen("", "", at=time.monotonic())
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self.current.body += body

    def on_message_complete(self) -> None:
        seen = self.current
        seen.method = self.parser.get_method().decode()
        seen.path = self.url.decode("latin-1")
        self.tap.record(seen)


class WireTap:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._seen: list[Seen] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="wire-tap")

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> WireTap:
        self._thread.start()
        assert self._ready.wait(10), "the wire tap did not start"
        return self

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def record(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)

    def seen(self, path: str | None = None, since: float = 0.0) -> list[Seen]:
        with self._lock:
            return [s for s in self._seen
                    if (path is None or s.path.split("?")[0] == path) and s.at >= since]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._relay, HOST, 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.target_port)
        except OSError:
            writer.close()
            return
        recorder = _Recorder(self)

        def parse(data: bytes) -> None:
            with contextlib.suppress(httptools.HttpParserError):  # relayed as is anyway
                recorder.parser.feed_data(data)

        await asyncio.gather(self._pump(reader, up_writer, parse),
                             self._pump(up_reader, writer, None))

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, parse) -> None:
        """Copy one direction until EOF or error, then close the other side entirely (a
        client that went away is a disconnect for the server, as without the tap)."""
        try:
            while data := await reader.read(65536):
                if parse is not None:
                    parse(data)
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
