"""What an error tells: a caller learns which leg failed and what its server said, never where
the servers are; the operator (the status page, traces, an admin route's answer) keeps the
addresses (docs/SECURITY.md, "What an error tells")."""

import orjson
import pytest
from starlette.requests import Request

from gateway.admission.auth import ADMIN, INFERENCE, Auth
from gateway.app import guarded
from gateway.errors import BadRequest, GatewayError, UpstreamError
from gateway.responses.store import StoreDown
from tests.unit.fakes import FakeCluster, FakeServer, run, served_gateway

P1, D1 = "http://127.0.0.1:30000", "http://127.0.0.1:30001"


def _no_address(text: str) -> bool:
    return "://" not in text and "127.0.0.1" not in text and "30001" not in text


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_decode_is_named_by_its_leg_to_the_caller_and_by_its_address_to_the_operator(
        stream):
    cluster = FakeCluster({P1: FakeServer("prefill"), D1: FakeServer("decode", status=500)})

    async def go():
        async with served_gateway(cluster, "--max-attempts", "1") as (client, gw):
            r = await client.post("/v1/chat/completions", json={
                "model": "fake", "stream": stream,
                "messages": [{"role": "user", "content": "hi"}]})
            return r, list(gw.state.recent_errors)

    r, kept = run(go())
    assert r.status_code == 502
    message = r.json()["error"]["message"]
    assert "decode server" in message and "500" in message and _no_address(message), message
    assert any(D1 in e["message"] for e in kept), kept  # the status page has it


def test_a_timeout_after_failures_says_the_last_failure_without_its_address():
    err = UpstreamError(f"decode server {D1}#dp1 timed out (read)", leg="decode",
                        server_url=D1, retryable=True, status=504)
    wrapped = GatewayError(f"deadline; last failure: {err.message}", status=504,
                           detail=f"deadline; last failure: {err.detail}")
    assert _no_address(err.message) and _no_address(wrapped.body()["error"]["message"])
    assert f"{D1}#dp1" in err.detail and f"{D1}#dp1" in wrapped.body(operator=True)["error"][
        "message"]


def test_server_side_failures_lose_their_addresses_and_the_callers_own_input_keeps_its_url():
    failed = GatewayError(f"no server could answer /v1/tokenize: http://[::1]:30000: "
                          f"ReadTimeout; {D1} answered 500: x", status=503)
    assert _no_address(failed.message) and "[::1]" not in failed.message
    assert "/v1/tokenize" in failed.message and "ReadTimeout" in failed.message
    # SGLang's own words name the KV transfer's peers bare (NetworkAddress.to_host_port_str)
    kv = UpstreamError(f"decode server {D1} answered 500: KVTransferError(bootstrap_room=7): "
                       "Failed to send kv chunk of 7 to 10.0.0.5:16000; peer [fd00::5]:8998, "
                       "prefill-0.pd.svc.cluster.local:8998", leg="decode", server_url=D1,
                       retryable=True)
    assert _no_address(kv.message) and "10.0.0.5" not in kv.message
    assert "fd00" not in kv.message and "svc.cluster" not in kv.message
    assert "Failed to send kv chunk of 7 to <address>" in kv.message and "10.0.0.5" in kv.detail
    refused = BadRequest("media URL https://example.com/cat.png needs --allow-media-urls")
    assert "https://example.com/cat.png" in refused.message  # 4xx: the caller's own input


def test_the_response_store_down_names_no_host_to_the_caller():
    down = StoreDown("redis: ConnectionError: Error 111 connecting to 10.1.2.3:6379.")
    assert "10.1.2.3" not in down.message and "10.1.2.3" in down.detail
    assert down.status == 503 and down.headers["retry-after"] == "2"


def _request(key: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/admin/servers/role",
                    "headers": [(b"authorization", f"Bearer {key}".encode()),
                                (b"host", b"127.0.0.1")],
                    "client": ("10.9.9.9", 5000), "query_string": b""})


@pytest.mark.parametrize("role", [ADMIN, INFERENCE])
def test_an_admin_route_answers_the_whole_detail_and_an_inference_route_the_message(role):
    async def breaks(request, parts):
        raise GatewayError(f"{D1} switched to prefill but did not answer as one", status=503)

    endpoint = guarded(breaks, role, Auth(("callerkey",), ("adminkey",)), None)
    key = "adminkey" if role is ADMIN else "callerkey"
    if role is ADMIN:
        message = orjson.loads(run(endpoint(_request(key))).body)["error"]["message"]
        assert message.startswith(D1)
    else:
        with pytest.raises(GatewayError) as caught:  # the app's handler renders `message`
            run(endpoint(_request(key)))
        assert _no_address(caught.value.message)


def test_server_info_tells_a_caller_the_servers_facts_and_an_admin_their_addresses():
    info = {"host": "10.4.0.7", "port": 30001, "dist_init_addr": "10.4.0.7:5000",
            "nccl_port": 28000, "otlp_traces_endpoint": "http://10.4.0.9:4317",
            "encoder_urls": ["http://10.4.0.8:9000"], "max_total_num_tokens": 4096,
            "report_interval": 5, "internal_states": [{"avg_spec_accept_length": 1.5}]}
    cluster = FakeCluster({P1: FakeServer("prefill", info=dict(info)),
                           D1: FakeServer("decode", info=dict(info))})

    async def go():
        async with served_gateway(cluster, "--api-keys", "callerkey",
                                  "--admin-api-keys", "adminkey") as (client, _):
            seen = {}
            for key in ("callerkey", "adminkey", "callerkey"):
                r = await client.get("/server_info", headers={"authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
                seen.setdefault(key, []).append(r.text)
            return seen

    seen = run(go())
    caller = orjson.loads(seen["callerkey"][0])
    assert seen["callerkey"][0] == seen["callerkey"][1]  # cached, as the full view is
    assert "10.4.0" not in seen["callerkey"][0] and "127.0.0.1" not in seen["callerkey"][0]
    assert "30001" not in seen["callerkey"][0] and "://" not in seen["callerkey"][0]
    decode = caller["decode"][0]
    assert decode["disaggregation_mode"] == "decode" and decode["max_total_num_tokens"] == 4096
    assert decode["report_interval"] == 5  # a word with "port" in it is not a port
    assert caller["internal_states"] == [{"avg_spec_accept_length": 1.5}]
    admin = orjson.loads(seen["adminkey"][0])
    assert admin["decode"][0]["url"] == D1 and admin["decode"][0]["dist_init_addr"] == \
        "10.4.0.7:5000"


def test_a_plain_error_with_a_4xx_status_is_the_callers_not_an_internal_one():
    assert GatewayError("a role switch is in progress", status=409).body()["error"]["type"] == \
        "invalid_request_error"
    assert GatewayError("boom").body()["error"]["type"] == "internal_error"
    assert GatewayError("late", status=504).body()["error"]["type"] == "timeout_error"
