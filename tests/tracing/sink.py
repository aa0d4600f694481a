"""An OTLP/HTTP trace receiver for tests, built from the official opentelemetry-proto messages.

It accepts `POST /v1/traces` with a protobuf `ExportTraceServiceRequest` (gzip or plain),
answers an `ExportTraceServiceResponse`, and keeps every span it decoded, flattened to a
`Span` record with its service name. It is the end of the pipeline in the tracing tests: the
gateway exports either to a real collector (rotel, which forwards here) or straight here.
"""

from __future__ import annotations

import contextlib
import gzip
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.procs import HOST

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass
class Span:
    service: str
    name: str
    kind: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root span
    attributes: dict
    events: list[tuple[str, dict]]
    status: int  # 0 unset, 1 ok, 2 error
    start_ns: int
    end_ns: int


def _value(value: AnyValue):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(items) -> dict:
    return {kv.key: _value(kv.value) for kv in items}


class Sink:
    """The spans received so far (thread-safe), and a way to wait for some."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self.lock = threading.Lock()

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(Span(
                        service=service, name=s.name, kind=KINDS.get(s.kind, str(s.kind)),
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(), attributes=_attributes(s.attributes),
                        events=[(e.name, _attributes(e.attributes)) for e in s.events],
                        status=s.status.code, start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano))
        with self.lock:
            self.requests += 1
            self.spans.extend(spans)

    def wait_for(self, predicate, timeout: float = 15.0) -> list[Span]:
        """The spans once `predicate(spans)` holds; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise AssertionError(f"spans did not arrive within {timeout}s; got {names}")
            time.sleep(0.05)


def _handler(sink: Sink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self._answer(404, b"")
                return
            try:
                sink.add(body)
            except Exception as exc:  # noqa: BLE001 - a bad body is a 400, as a collector says
                self._answer(400, str(exc).encode())
                return
            self._answer(200, ExportTraceServiceResponse().SerializeToString())

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    return Handler


@contextlib.contextmanager
def serving() -> Iterator[tuple[Sink, str]]:
    """A sink on a free loopback port, and its base URL (`http://127.0.0.1:PORT`)."""
    sink = Sink()
    server = ThreadingHTTPServer((HOST, 0), _handler(sink))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield sink, f"http://{HOST}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
