"""Traces end to end: a real gateway process exports to a real collector (rotel, over OTLP
gRPC and HTTP) or straight to the proto-built sink; simulated servers record the trace
headers each leg carried. Requests with and without a client traceparent, streamed or not."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.procs import HOST, free_port, running
from tests.tracing.conftest import SERVICE, gateway_argv

CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module", params=["http/protobuf", "grpc", "direct"])
def traced(request, pipeline):
    """(gateway URL, sink, sims): a gateway exporting to rotel over the protocol, or to the
    sink directly."""
    sink, collector, sims, log_dir = pipeline
    protocol = "http/protobuf" if request.param == "direct" else request.param
    port = free_port()
    argv = gateway_argv(sims, collector[request.param], protocol, port)
    url = f"http://{HOST}:{port}"
    name = f"gateway-{request.param.replace('/', '-')}"
    with running(name, argv, log_dir, url + "/readiness"):
        yield url, sink, sims


def trace_of(sink, request_id: str, names: set[str]) -> dict[str, list]:
    """The spans of the request (by its request id), once all of `names` arrived."""
    def ready(spans):
        root = [s for s in spans if s.attributes.get("gateway.request_id") == request_id]
        if not root:
            return False
        got = {s.name for s in spans if s.trace_id == root[0].trace_id}
        return names <= got

    spans = sink.wait_for(ready)
    root = next(s for s in spans if s.attributes.get("gateway.request_id") == request_id)
    out: dict[str, list] = {}
    for span in spans:
        if span.trace_id == root.trace_id:
            out.setdefault(span.name, []).append(span)
    return out


def sent_headers(sims, url: str, rid: str) -> dict:
    """The trace headers the simulated server at `url` received for upstream rid `rid`."""
    traces = sims.stats(url)["traces"]
    (entry,) = [t for t in traces if rid in t["rids"]]
    return entry["headers"]


def check_legs(spans, sims, request_span, tracestate=None) -> None:
    (pick,) = spans["pick"]
    assert pick.parent_id == request_span.span_id and pick.kind == "INTERNAL"
    assert pick.attributes["gateway.prefill.policy"] == "auto"  # the defaults
    assert pick.attributes["gateway.decode.policy"] == "auto"
    assert pick.attributes["gateway.retry"] == 0
    for leg, chosen in (("prefill", "gateway.prefill.server"), ("decode", "gateway.decode.server")):
        (span,) = spans[leg]
        assert span.kind == "CLIENT" and span.parent_id == request_span.span_id
        assert span.service == SERVICE
        assert span.attributes["server.address"] == pick.attributes[chosen]
        assert span.attributes["http.response.status_code"] == 200
        assert span.attributes["gateway.outcome"] == "ok"
        assert span.attributes["gateway.retry"] == 0
        headers = sent_headers(sims, span.attributes["server.address"],
                               span.attributes["gateway.rid"])
        prefix, flags = headers["traceparent"].rsplit("-", 1)
        assert prefix == f"00-{span.trace_id}-{span.span_id}" and int(flags, 16) & 1  # sampled
        assert headers.get("tracestate") == tracestate


def test_a_request_without_traceparent_starts_a_trace_that_reaches_both_legs(traced):
    gateway, sink, sims = traced
    request_id = f"t-{uuid.uuid4().hex}"
    r = httpx.post(gateway + "/generate", headers={"x-request-id": request_id}, timeout=30,
                   json={"text": "hello tracing", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    spans = trace_of(sink, request_id, {"POST /generate", "pick", "prefill", "decode"})
    (request,) = spans["POST /generate"]
    assert request.parent_id == "" and request.kind == "SERVER"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["http.route"] == "/generate"
    assert request.attributes["gateway.stream"] is False
    check_legs(spans, sims, request)
    assert "relay" not in spans


def test_a_client_traceparent_parents_the_request_and_a_stream_has_its_relay(traced):
    gateway, sink, sims = traced
    request_id, client_trace = f"t-{uuid.uuid4().hex}", uuid.uuid4().hex  # one trace per run
    headers = {"x-request-id": request_id, "tracestate": "team=search",
               "traceparent": f"00-{client_trace}-{CLIENT_SPAN}-01"}
    with httpx.stream("POST", gateway + "/v1/chat/completions", headers=headers, timeout=30,
                      json={"model": "sim-model", "stream": True, "max_tokens": 8,
                            "messages": [{"role": "user", "content": "stream it"}]}) as r:
        assert r.status_code == 200
        body = b"".join(r.iter_bytes())
    assert body.endswith(b"data: [DONE]\n\n")
    names = {"POST /v1/chat/completions", "pick", "prefill", "decode", "relay"}
    spans = trace_of(sink, request_id, names)
    (request,) = spans["POST /v1/chat/completions"]
    assert request.trace_id == client_trace and request.parent_id == CLIENT_SPAN
    check_legs(spans, sims, request, tracestate="team=search")
    (relay,) = spans["relay"]
    assert relay.parent_id == request.span_id
    assert relay.attributes["gateway.relay.end"] == "complete"
    # what the relay passed on: the client's bytes plus the usage event the gateway asked
    # for (usage accounting) and cut, the client not having asked for it
    assert len(body) < relay.attributes["gateway.relay.bytes"] <= len(body) + 512
    assert relay.attributes["gateway.relay.chunks"] >= 2
    (decode,) = spans["decode"]
    assert decode.end_ns >= relay.start_ns


def test_a_malformed_traceparent_is_ignored(traced):
    gateway, sink, sims = traced
    request_id, client_trace = f"t-{uuid.uuid4().hex}", uuid.uuid4().hex
    bad = f"00-{client_trace.upper()}-{CLIENT_SPAN}-01"
    r = httpx.post(gateway + "/generate", timeout=30,
                   headers={"x-request-id": request_id, "traceparent": bad},
                   json={"text": "malformed", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
    spans = trace_of(sink, request_id, {"POST /generate", "prefill", "decode"})
    (request,) = spans["POST /generate"]
    assert request.parent_id == "" and request.trace_id != client_trace
    check_legs(spans, sims, request)
