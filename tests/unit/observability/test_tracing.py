"""Tracing: which client trace contexts are trusted, the spans of a request and their shape,
what each leg is sent, drops counted, and nothing loaded when tracing is off (no sockets:
spans go to the SDK's in-memory exporter instead of OTLP)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing extra not installed: "
                    "pip install -e '.[tracing]'")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from prometheus_client import CollectorRegistry, Counter  # noqa: E402

from gateway.config.settings import ConfigError  # noqa: E402
from gateway.observability.tracing import client_carrier  # noqa: E402
from gateway.observability.tracing_export import DropMetrics  # noqa: E402
from tests.unit.fakes import FakeCluster, FakeServer, make_app  # noqa: E402

P1, P2 = "http://127.0.0.1:30000", "http://127.0.0.1:30002"
D1, D2 = "http://127.0.0.1:30001", "http://127.0.0.1:30003"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{PARENT}-01"
TRACING = ["--otlp-endpoint", "http://127.0.0.1:9/v1/traces"]  # never reached: in memory


@pytest.mark.parametrize("headers, expected", [
    ([(b"traceparent", GOOD.encode())], {"traceparent": GOOD}),
    ([(b"traceparent", GOOD.upper().encode())], None),
    ([(b"traceparent", f"ff-{TRACE}-{PARENT}-01".encode())], None),
    ([(b"traceparent", (GOOD + "-extra").encode())], None),
    ([(b"traceparent", f"01-{TRACE}-{PARENT}-01-future".encode())],
     {"traceparent": f"01-{TRACE}-{PARENT}-01-future"}),
    ([(b"traceparent", f"01-{TRACE}-{PARENT}-01-{'x' * 80}".encode())], None),
    ([(b"traceparent", f"00-{'0' * 32}-{PARENT}-01".encode())], None),
    ([(b"traceparent", f"00-{TRACE}-{'0' * 16}-01".encode())], None),
    ([(b"traceparent", b"00-abc-def-01")], None),
    ([(b"traceparent", GOOD.encode()), (b"traceparent", GOOD.encode())], None),
    ([(b"tracestate", b"a=1")], None),
    ([(b"traceparent", GOOD.encode()), (b"tracestate", b"congo=t61rcWkgMzE, ro@vendor=x")],
     {"traceparent": GOOD, "tracestate": "congo=t61rcWkgMzE, ro@vendor=x"}),
    ([(b"traceparent", GOOD.encode()), (b"tracestate", b"a=1"), (b"tracestate", b"b=2")],
     {"traceparent": GOOD, "tracestate": "a=1,b=2"}),
    ([(b"traceparent", GOOD.encode()), (b"tracestate", b"k=" + b"v" * 600)],
     {"traceparent": GOOD}),
    ([(b"traceparent", GOOD.encode()), (b"tracestate", b"Bad Key=1")], {"traceparent": GOOD}),
    ([(b"traceparent", GOOD.encode()), (b"tracestate", b"a=1,a=2")], {"traceparent": GOOD}),
    ([(b"traceparent", GOOD.encode()),
      (b"tracestate", ",".join(f"k{i}=v" for i in range(33)).encode())], {"traceparent": GOOD}),
], ids=["valid", "uppercase", "version-ff", "v00-with-more", "future-version",
        "future-too-long", "zero-trace-id", "zero-parent-id", "short-ids", "two-traceparents",
        "tracestate-alone", "tracestate-kept", "tracestates-joined", "tracestate-too-long",
        "tracestate-bad-key", "tracestate-duplicate-key", "tracestate-33-members"])
def test_client_trace_context_is_validated(headers, expected):
    assert client_carrier(headers) == expected


@contextlib.asynccontextmanager
async def traced_gateway(cluster, *extra):
    app = make_app(cluster, *TRACING, *extra)
    memory = InMemorySpanExporter()
    gateway = app.state.gateway
    gateway.tracing.export.exporter_class = lambda endpoint, timeout: memory
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield client, gateway, memory


async def spans_of(gateway, memory) -> dict[str, list]:
    """The finished spans by name, once the prefill legs that trail their answers are done."""
    for _ in range(200):
        if not gateway.dispatcher.chores.busy():
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)
    gateway.tracing.export.processor.force_flush(5000)
    out: dict[str, list] = {}
    for span in memory.get_finished_spans():
        out.setdefault(span.name, []).append(span)
    return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_request_with_a_client_traceparent_joins_its_trace_and_legs_carry_their_spans():
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode")})

    async def go():
        async with traced_gateway(cluster) as (client, gateway, memory):
            r = await client.post("/generate", json={"text": "hello"},
                                  headers={"traceparent": GOOD, "tracestate": "team=blue"})
            assert r.status_code == 200
            return await spans_of(gateway, memory)

    spans = run(go())
    (request,) = spans["POST /generate"]
    assert request.context.trace_id == int(TRACE, 16)
    assert request.parent.span_id == int(PARENT, 16) and request.parent.is_remote
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["gateway.tenant"] == "anonymous"
    assert request.attributes["gateway.attempts"] == 1
    (pick,) = spans["pick"]
    assert pick.attributes["gateway.prefill.server"] == P1
    assert pick.attributes["gateway.decode.server"] == D1
    assert pick.attributes["gateway.prefill.policy"] == "round_robin"
    assert pick.attributes["gateway.retry"] == 0
    for leg, url in (("prefill", P1), ("decode", D1)):
        (span,) = spans[leg]
        assert span.parent.span_id == request.context.span_id
        assert span.context.trace_id == int(TRACE, 16)
        assert span.attributes["server.address"] == url
        assert span.attributes["http.response.status_code"] == 200
        assert span.attributes["gateway.outcome"] == "ok"
        sent = cluster.servers[url].headers[0]
        assert sent["traceparent"] == f"00-{TRACE}-{span.context.span_id:016x}-01"
        assert sent["tracestate"] == "team=blue"
        room = cluster.servers[url].received[0]["bootstrap_room"]
        assert span.attributes["gateway.bootstrap_room"] == room
    assert pick.parent.span_id == request.context.span_id
    assert "relay" not in spans  # not a stream


def test_a_malformed_traceparent_is_ignored_and_a_new_trace_starts():
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode")})

    async def go():
        async with traced_gateway(cluster) as (client, gateway, memory):
            await client.post("/generate", json={"text": "hi"},
                              headers={"traceparent": f"00-{TRACE}-{PARENT}-01-junk"})
            return await spans_of(gateway, memory)

    spans = run(go())
    (request,) = spans["POST /generate"]
    assert request.parent is None and request.context.trace_id != int(TRACE, 16)
    sent = cluster.servers[D1].headers[0]["traceparent"]
    assert sent.split("-")[1] == f"{request.context.trace_id:032x}"


def test_a_stream_has_a_relay_span_with_chunks_bytes_and_its_end():
    chunks = [b'data: {"text": "a"}\n\n', b'data: {"text": "ab"}\n\n', b"data: [DONE]\n\n"]
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", chunks=chunks)})

    async def go():
        async with traced_gateway(cluster) as (client, gateway, memory):
            r = await client.post("/generate", json={"text": "s", "stream": True})
            assert r.status_code == 200 and r.content == b"".join(chunks)
            return await spans_of(gateway, memory)

    spans = run(go())
    (relay,) = spans["relay"]
    (request,) = spans["POST /generate"]
    assert relay.parent.span_id == request.context.span_id
    assert relay.attributes["gateway.relay.end"] == "complete"
    assert relay.attributes["gateway.relay.bytes"] == sum(map(len, chunks))
    assert relay.attributes["gateway.relay.chunks"] >= 1
    (decode,) = spans["decode"]
    assert decode.end_time >= relay.start_time  # the decode leg lasts as long as its stream
    assert request.attributes["gateway.stream"] is True


def test_a_retry_has_its_own_pick_and_legs_and_says_why():
    cluster = FakeCluster({P1: FakeServer("prefill", status=500), P2: FakeServer("prefill"),
                           D1: FakeServer("decode", delay=0.05),
                           D2: FakeServer("decode", delay=0.05)})

    async def go():
        async with traced_gateway(cluster) as (client, gateway, memory):
            r = await client.post("/generate", json={"text": "again"})
            assert r.status_code == 200
            return await spans_of(gateway, memory)

    spans = run(go())
    assert sorted(p.attributes["gateway.retry"] for p in spans["pick"]) == [0, 1]
    failed = [s for s in spans["prefill"] if s.attributes["gateway.outcome"] == "failed"]
    assert len(failed) == 1 and failed[0].attributes["http.response.status_code"] == 500
    assert failed[0].attributes["gateway.retry"] == 0
    (request,) = spans["POST /generate"]
    (event,) = [e for e in request.events if e.name == "attempt_failed"]
    assert event.attributes["gateway.leg"] == "prefill"
    assert "answered 500" in event.attributes["exception.message"]
    assert request.attributes["gateway.attempts"] == 2


def test_an_upstream_4xx_marks_the_leg_refused_and_the_request_keeps_its_status():
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", status=400)})

    async def go():
        async with traced_gateway(cluster) as (client, gateway, memory):
            r = await client.post("/generate", json={"text": "bad"})
            assert r.status_code == 400
            return await spans_of(gateway, memory)

    spans = run(go())
    (decode,) = spans["decode"]
    assert decode.attributes["gateway.outcome"] == "refused"
    (request,) = spans["POST /generate"]
    assert request.attributes["http.response.status_code"] == 400


def test_a_sample_ratio_of_zero_records_nothing_but_a_sampled_parent_is_followed():
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode")})

    async def go():
        async with traced_gateway(cluster, "--otlp-sample-ratio", "0") as (client, gw, memory):
            await client.post("/generate", json={"text": "a"})
            unsampled = cluster.servers[D1].headers[-1]["traceparent"]
            flags = int(unsampled.rsplit("-", 1)[1], 16)
            assert not await spans_of(gw, memory) and not flags & 1  # propagated, unsampled
            await client.post("/generate", json={"text": "b"}, headers={"traceparent": GOOD})
            return await spans_of(gw, memory)

    spans = run(go())
    assert spans["POST /generate"][0].context.trace_id == int(TRACE, 16)


def test_dropped_spans_are_counted():
    counter = Counter("dropped", "test", ["reason"], registry=CollectorRegistry())
    release = threading.Event()

    class Stuck(InMemorySpanExporter):
        def export(self, spans):
            release.wait(10)
            return SpanExportResult.SUCCESS

    processor = BatchSpanProcessor(Stuck(), max_queue_size=2, max_export_batch_size=1,
                                   schedule_delay_millis=1)
    assert DropMetrics(counter).attach(processor)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("test")
    try:
        for _ in range(20):
            tracer.start_span("s").end()
        dropped = counter.labels("queue_full")._value.get()
        assert 17 <= dropped <= 18  # 20 minus the queue (2) minus the one being exported
    finally:
        release.set()
        processor.shutdown()


def test_tracing_without_its_packages_is_a_configuration_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gateway.observability.tracing", None)  # import fails
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode")})
    with pytest.raises(ConfigError, match=r"pd-gateway\[tracing\]"):
        make_app(cluster, *TRACING)


def test_tracing_off_loads_nothing_of_it():
    code = ("import sys; from gateway.app import build_app; from gateway.config.settings import "
            "load_config; app = build_app(load_config(['--prefill', 'http://a:1', '--decode', "
            "'http://b:2'], environ={})); assert app.state.gateway.tracing is None; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', "
            "'gateway.observability.tracing'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"
