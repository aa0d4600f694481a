"""The data-path clients by name, and each adapter's translation of its library's errors."""

from __future__ import annotations

import sys
import typing
from types import SimpleNamespace

import aiohttp
import httpx
import pytest
from aiohttp.http_exceptions import BadHttpMessage

from gateway.config.schema import GatewayConfig
from gateway.config.settings import ConfigError, load_config
from gateway.upstream import aiohttp_client, httpx_client
from gateway.upstream.choices import UPSTREAM_CLIENTS, upstream_class
from gateway.upstream.client import translated
from gateway.upstream.errors import mapped

KEY = SimpleNamespace(host="d", port=30001, ssl=True)  # aiohttp's ConnectionKey, in short
BASE = ["--prefill", "http://p:30000", "8998", "--decode", "http://d:30001"]


def test_the_flag_offers_exactly_the_table():
    hints = typing.get_type_hints(GatewayConfig)
    assert set(typing.get_args(hints["upstream_client"])) == set(UPSTREAM_CLIENTS)


@pytest.mark.parametrize("name", sorted(UPSTREAM_CLIENTS))
def test_each_name_resolves_to_an_adapter(name):
    adapter = upstream_class(name)
    assert adapter.__name__ == UPSTREAM_CLIENTS[name].rpartition(":")[2]
    assert all(callable(getattr(adapter, part)) for part in ("open", "post", "close"))


def test_a_missing_optional_client_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "gateway.upstream.aiohttp_client")
    upstream_class.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"pip install 'pd-gateway\[aiohttp\]'"):
            load_config(BASE + ["--upstream-client", "aiohttp"])
        assert load_config(BASE).upstream_client == "fast"  # not needed unless chosen
    finally:
        upstream_class.cache_clear()


def _answer(table, exc):
    """What the client is told when the adapter with `table` meets `exc`."""
    error = translated("decode", "http://d", mapped(exc, table))
    return error.status, error.retryable, str(error)


@pytest.mark.parametrize("exc, expected", [
    (httpx.PoolTimeout("no room"), (503, "is busy: no room")),
    (httpx.ConnectError("refused"), (502, "refused or dropped the connection: refused")),
    (httpx.ConnectTimeout("slow"), (504, "timed out (ConnectTimeout)")),
    (httpx.ReadTimeout("slow"), (504, "timed out (ReadTimeout)")),
    (httpx.RemoteProtocolError("cut"), (502, "failed: RemoteProtocolError: cut")),
], ids=["pool", "connect", "connect-timeout", "read-timeout", "protocol"])
def test_httpx_errors(exc, expected):
    status, retryable, message = _answer(httpx_client.ERRORS, exc)
    assert retryable and (status, message.partition("http://d ")[2]) == expected


@pytest.mark.parametrize("exc, expected", [
    (aiohttp.SocketTimeoutError("slow"), (504, "timed out (SocketTimeoutError)")),
    (aiohttp.ClientConnectorError(KEY, OSError(111, "refused")), (502, "refused")),
    (aiohttp.ClientPayloadError("cut"), (502, "failed: ClientPayloadError: cut")),
    (BadHttpMessage("bad"), (502, "failed: BadHttpMessage")),
], ids=["timeout", "connect", "payload", "bad-message"])
def test_aiohttp_errors(exc, expected):
    status, retryable, message = _answer(aiohttp_client.ERRORS, exc)
    assert retryable and status == expected[0] and expected[1] in message


def test_the_callers_own_deadline_passes_as_it_is():
    assert translated("decode", "http://d", TimeoutError()) is None


def test_a_refused_connection_of_the_fast_client_is_marked_refused():
    """Nothing listens: the request was never sent, so the retry does not spend an attempt
    (gateway/dispatch/proxy.py FREE)."""
    import asyncio
    import socket

    from gateway.upstream.errors import ConnectFailed
    from gateway.upstream.http11 import HTTPClient

    with socket.socket() as probe:  # a port nobody listens on: bound, never listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

        async def go() -> ConnectFailed:
            client = HTTPClient(connect_timeout=2.0)
            try:
                await client.post(f"http://127.0.0.1:{port}", "/generate", b"{}")
            except ConnectFailed as exc:
                return exc
            finally:
                client.close()
            raise AssertionError("connected")

        error = asyncio.run(go())
    upstream = translated("decode", f"http://127.0.0.1:{port}", error)
    assert upstream is not None and upstream.retryable and upstream.reason == "refused"
    other = translated("decode", "http://d", ConnectFailed("connect to d timed out"))
    assert other is not None and other.reason is None
