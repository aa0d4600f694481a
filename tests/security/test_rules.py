"""The rules behind the defences, attacked in process (no sockets): who counts as loopback,
how keys are compared, what is redacted, where keys may come from.

Every client of the suite's real gateways is on loopback, so "a stranger on the network" is
played here through the ASGI scope's client address, against the real app and its route
table, on the shipped defaults (no keys at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac

import httpx
import pytest

from gateway.admission import auth
from gateway.app import ROUTES, Role, build_app
from gateway.cli import keys_on_command_line
from gateway.config.servers import validate_url
from gateway.config.settings import ConfigError, load_config
from gateway.redact import redact
from tests.unit.fakes import FakeCluster, FakeServer

P, D = "http://127.0.0.1:30000", "http://127.0.0.1:30001"
SERVERS = ["--prefill", P, "--decode", D]
STRANGER = ("203.0.113.9", 40000)
ADMIN_ROUTES = [(m, path) for path, methods, _, role in ROUTES if role is Role.ADMIN
                for m in methods]
SPOOFS = [{}, {"x-forwarded-for": "127.0.0.1"}, {"x-real-ip": "127.0.0.1"},
          {"forwarded": "for=127.0.0.1"}, {"host": "localhost"}]


class LeakyCluster(FakeCluster):
    """Fake servers whose /server_info carries secrets, as SGLang's server_args may."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            role = self.servers[f"http://{request.url.host}:{request.url.port}"].role
            return httpx.Response(200, json={
                "disaggregation_mode": role, "disaggregation_bootstrap_port": 8998,
                "api_key": "sk-server-secret", "admin_api_key": "sk-admin-secret",
                "hf_token": "hf_secret", "ssl_keyfile_password": "pw",
                "model_path": "https://user:hub-secret@hub.example/model",
                "max_total_num_tokens": 400000, "tokenizer_path": "/models/tok",
                "enable_auth": False, "internal_states": [{"token_usage": 0.1}]})
        if request.url.path in ("/v1/models", "/model_info"):
            return httpx.Response(200, json={"data": [{"id": "fake", "api_key": "sk-server-secret",
                                                       "root": "https://u:hub-secret@hub/x"}]})
        return await super().handle(request)


@contextlib.asynccontextmanager
async def in_process(*args: str, environ: dict | None = None):
    cluster = LeakyCluster({P: FakeServer("prefill"), D: FakeServer("decode")})
    app = build_app(load_config([*SERVERS, *args], environ=environ or {}),
                    transport=httpx.MockTransport(cluster.handle))
    async with app.router.lifespan_context(app):
        def client(address):
            transport = httpx.ASGITransport(app=app, client=address)
            return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1")
        yield client


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_strangers_are_refused_every_admin_route_on_the_defaults():
    async def go():
        async with in_process() as client:
            async with client(STRANGER) as stranger, client(("127.0.0.1", 5)) as local:
                for method, path in ADMIN_ROUTES:
                    for headers in SPOOFS:
                        r = await stranger.request(method, path, headers=headers,
                                                   json={"url": "http://127.0.0.1:9"})
                        assert r.status_code == 403, (method, path, headers, r.text)
                assert (await local.get("/admin/servers")).status_code == 200
                assert (await stranger.post("/abort_request", json={"abort_all": True})
                        ).status_code == 403
    run(go())


@pytest.mark.parametrize("address, loopback", [
    (("127.0.0.1", 1), True), (("127.8.9.10", 1), True), (("::1", 1, 0, 0), True),
    (("::ffff:127.0.0.1", 1, 0, 0), False), (("10.0.0.1", 1), False), (("0.0.0.0", 1), False),
    (("fe80::1%eth0", 1, 0, 2), False), (("localhost", 1), False), (None, False),
    (("", 0), False), (("unix:/tmp/gateway.sock", 0), False),
], ids=lambda v: str(v))
def test_loopback_is_the_socket_address_only(address, loopback):
    assert auth.is_loopback(address) is loopback
    scope = {"client": address, "headers": [(b"x-forwarded-for", b"127.0.0.1")]}
    needed = auth.Auth((), ())
    if loopback:
        assert needed.caller(scope, Role.ADMIN).is_admin
    else:
        with pytest.raises(auth.Forbidden):
            needed.caller(scope, Role.ADMIN)


def test_anonymous_callers_own_their_requests_per_address():
    keys = auth.Auth((), ())
    one = keys.caller({"client": STRANGER, "headers": []}, Role.INFERENCE)
    other = keys.caller({"client": ("198.51.100.7", 1), "headers": []}, Role.INFERENCE)
    assert one.owner != other.owner and not one.is_admin and not other.is_admin


def test_keys_are_compared_as_equal_length_digests_against_every_key(monkeypatch):
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = auth.Auth(("first-key", "second-key", "third-key"), ("admin-key",))
    for presented in ("first-key", "third-key", "x", "y" * 5000, "admin-key"):
        compared.clear()
        with contextlib.suppress(auth.Unauthorized):
            keys.caller({"client": STRANGER, "headers": [
                (b"authorization", b"Bearer " + presented.encode())]}, Role.INFERENCE)
        assert compared == [(32, 32)] * 4, (presented, compared)  # no early exit, no length


def test_redaction_hides_secrets_and_keeps_figures():
    info = {"api_key": "sk-1", "admin_api_key": "sk-2", "hf_token": "hf", "apiKey": "k",
            "ssl_keyfile_password": "pw", "nested": [{"auth_token": "t", "secret": {"a": 1}}],
            "api_key_unset": None, "empty_token": "", "enable_auth": True,
            "model_path": "s3://AKIA:hidden@bucket/model", "max_total_num_tokens": 7,
            "tokenizer_path": "/tok", "skip_tokenizer_init": False, "ssl_keyfile": "/k.pem",
            "token_usage": 0.5, "email": "ops@example.com"}
    out = redact(info)
    for name in ("api_key", "admin_api_key", "hf_token", "apiKey", "ssl_keyfile_password"):
        assert out[name] == "<redacted>", name
    assert out["nested"] == [{"auth_token": "<redacted>", "secret": "<redacted>"}]
    assert out["model_path"] == "s3://<redacted>@bucket/model"
    for name in ("api_key_unset", "empty_token", "enable_auth", "max_total_num_tokens",
                 "tokenizer_path", "skip_tokenizer_init", "ssl_keyfile", "token_usage", "email"):
        assert out[name] == info[name], name


def test_server_info_through_the_app_carries_no_server_secret():
    async def go():
        async with in_process() as client, client(STRANGER) as stranger:
            for path in ("/server_info", "/v1/models", "/model_info"):
                r = await stranger.get(path)
                assert r.status_code in (200, 503), (path, r.text)
                for secret in ("sk-server-secret", "sk-admin-secret", "hf_secret", "hub-secret"):
                    assert secret not in r.text, (path, secret)
            info = (await stranger.get("/server_info")).json()
            assert info["decode"][0]["max_total_num_tokens"] == 400000
    run(go())


def test_keys_come_from_files_or_the_environment(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\n\nfile-key-1\r\nfile-key-2\n")
    admin = tmp_path / "admin"
    admin.write_text("admin-from-file\n")
    cfg = load_config([*SERVERS, "--api-key-file", str(keys), "--admin-api-key-file",
                       str(admin)], environ={})
    assert cfg.api_keys == ("file-key-1", "file-key-2")
    assert cfg.admin_api_keys == ("admin-from-file",)
    cfg = load_config(SERVERS, environ={"GATEWAY_API_KEYS": "env-1,env-2",
                                        "GATEWAY_ADMIN_API_KEYS": "env-admin"})
    assert (cfg.api_keys, cfg.admin_api_keys) == (("env-1", "env-2"), ("env-admin",))
    cfg = load_config(SERVERS, environ={"GATEWAY_API_KEY_FILE": str(keys)})
    assert cfg.api_keys == ("file-key-1", "file-key-2")


@pytest.mark.parametrize("content", ["", "\n\n", "# only a comment\n"])
def test_an_empty_key_file_is_an_error_not_an_open_gateway(tmp_path, content):
    empty = tmp_path / "keys"
    empty.write_text(content)
    for flag in ("--api-key-file", "--admin-api-key-file"):
        with pytest.raises(ConfigError, match="holds no key"):
            load_config([*SERVERS, flag, str(empty)], environ={})


def test_bad_keys_are_refused(tmp_path):
    for env in ({"GATEWAY_API_KEYS": "has space"}, {"GATEWAY_API_KEYS": "tab\tkey"},
                {"GATEWAY_API_KEYS": "same", "GATEWAY_ADMIN_API_KEYS": "same"}):
        with pytest.raises(ConfigError):
            load_config(SERVERS, environ=env)


def test_keys_on_the_command_line_are_flagged():
    assert keys_on_command_line(["--api-keys", "a", "--admin-api-keys=b", "--api-key", "c"]) \
        == ["--api-keys", "--admin-api-keys", "--api-key"]
    assert keys_on_command_line(["--api-key-file", "/run/keys", "--port", "1"]) == []


@pytest.mark.parametrize("url", ["http://:secret@127.0.0.1:30000", "http://@127.0.0.1:30000"])
def test_server_urls_from_the_config_carry_no_userinfo(url):
    with pytest.raises(ConfigError):
        validate_url(url)
