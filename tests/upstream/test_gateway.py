"""The whole gateway on each data-path client, over real sockets to raw PD servers: plain and
https upstreams (the CA from --upstream-ca-file), streaming and not; and the settings."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest

from gateway.app import build_app
from gateway.config.settings import ConfigError, load_config
from gateway.runtime import Gateway
from tests.upstream.raw import RawServer, response, run

SSE_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def pd_server(conn) -> None:
    """Answers like an SGLang PD server: JSON for /generate, SSE when asked to stream, 200 for
    anything else (health, loads)."""
    while (request := await conn.request()) is not None:
        if not request.head.startswith(b"POST /generate"):
            await conn.send(response(b"{}"))
            continue
        body = json.loads(request.body)
        assert isinstance(body["bootstrap_room"], int)
        if body.get("stream"):
            await conn.send(SSE_HEAD + _chunk(b'data: {"text": "one"}\n\n')
                            + _chunk(b'data: {"text": "one two"}\n\n')
                            + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            answer = json.dumps({"text": "answer", "meta_info": {"prompt_tokens": 3}})
            await conn.send(response(answer.encode()))


@contextlib.asynccontextmanager
async def gateway(*argv: str):
    app = build_app(load_config(["--skip-probe", "--health-interval", "60",
                                 "--loads-interval", "0", *argv]))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield client


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_pd_requests_through_each_client(kind, tls, certs):
    async def go():
        server_tls = certs.server_context() if tls else None
        async with RawServer(pd_server, tls=server_tls) as prefill, \
                RawServer(pd_server, tls=server_tls) as decode:
            extra = ["--upstream-ca-file", str(certs.ca_file)] if tls else []
            async with gateway("--prefill", prefill.url, "8998", "--decode", decode.url,
                               "--upstream-client", kind, *extra) as client:
                r = await client.post("/generate", json={"text": "hi"})
                assert r.status_code == 200, r.text
                assert r.json()["text"] == "answer"
                r = await client.post("/generate", json={"text": "hi", "stream": True})
                assert r.status_code == 200
                assert r.text.endswith("data: [DONE]\n\n")
                assert '"one two"' in r.text
                # the prefill leg of a stream may still be on its way: wait for it
                await prefill.wait_requests(2, prefix=b"POST /generate")
            for server in (prefill, decode):
                assert sum(q.head.startswith(b"POST /generate") for q in server.requests) == 2

    run(go(), timeout=30)


def test_https_upstream_without_the_ca_fails_the_leg_not_the_gateway(certs):
    async def go():
        async with RawServer(pd_server, tls=certs.server_context()) as prefill, \
                RawServer(pd_server, tls=certs.server_context()) as decode:
            async with gateway("--prefill", prefill.url, "8998", "--decode", decode.url,
                               "--max-attempts", "1") as client:
                r = await client.post("/generate", json={"text": "hi"})
            assert r.status_code == 502
            assert "certificate" in r.json()["error"]["message"].lower()
            assert not prefill.requests and not decode.requests

    run(go(), timeout=30)


BASE = ["--prefill", "https://p:30000", "8998", "--decode", "https://d:30001"]


def test_settings_defaults_and_choices():
    cfg = load_config(BASE)
    assert (cfg.upstream_client, cfg.upstream_max_connections, cfg.upstream_pool_timeout,
            cfg.upstream_ca_file, cfg.upstream_insecure) == ("fast", 512, 30.0, None, False)
    for client in ("fast", "aiohttp", "httpx"):
        assert load_config(BASE + ["--upstream-client", client]).upstream_client == client
    with pytest.raises(ConfigError):
        load_config(BASE + ["--upstream-client", "requests"])
    assert load_config(BASE, environ={"GATEWAY_UPSTREAM_INSECURE": "1"}).upstream_insecure
    assert load_config(BASE + ["--upstream-max-connections", "64"]).upstream_max_connections == 64


@pytest.mark.parametrize("flags", [
    ["--upstream-max-connections", "0"], ["--upstream-pool-timeout", "0"],
    ["--upstream-ca-file", "/nonexistent/ca.pem"], ["--upstream-ca-file", "BAD"],
], ids=["no-connections", "no-wait", "missing-ca", "ca-not-a-certificate"])
def test_bad_upstream_settings_are_config_errors(flags, tmp_path):
    """Refused when the app is built, before the port is bound (exit 2)."""
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    flags = [str(bad) if flag == "BAD" else flag for flag in flags]
    with pytest.raises(ConfigError, match="upstream_"):
        Gateway(load_config(BASE + flags))


def test_insecure_is_warned_about_at_start(caplog):
    async def go():
        async with gateway(*BASE, "--upstream-insecure"):
            pass

    with caplog.at_level("WARNING", logger="gateway"):
        run(go())
    assert any("NOT verified" in record.getMessage() for record in caplog.records)
