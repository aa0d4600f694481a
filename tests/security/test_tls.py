"""TLS on the client side, and client certificates (mTLS).

A CA and a server certificate for 127.0.0.1 are made at test time; a second CA stands for
everyone else. Plain HTTP and clients that do not trust the gateway's CA get nothing; with
`--ssl-ca-certs`, clients without a certificate of that CA are refused in the handshake.
Honest clients with the right CA (and certificate) run beside every attack.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.config.settings import ConfigError, load_config
from tests.security.certs import Authority, client_context
from tests.security.honest import Honest, exchange
from tests.security.rig import start_gateway

HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def pki(logs):
    directory = logs / "pki"
    directory.mkdir(exist_ok=True)
    ca, other = Authority(directory, "gateway-ca"), Authority(directory, "other-ca")
    return {"ca": ca, "other": other, "server": ca.issue("server", server=True),
            "client": ca.issue("client", server=False),
            "stranger": other.issue("stranger", server=False),
            "impostor": other.issue("impostor", server=True)}


@pytest.fixture(scope="module")
def tls(logs, sims, pki) -> Iterator:
    server = pki["server"]
    gateway = start_gateway(logs, "tls", sims, ["--ssl-certfile", str(server.cert),
                                                "--ssl-keyfile", str(server.key)],
                            scheme="https", verify=client_context(pki["ca"]))
    yield gateway
    gateway.stop()


@pytest.fixture(scope="module")
def mtls(logs, sims, pki) -> Iterator:
    server = pki["server"]
    gateway = start_gateway(logs, "mtls", sims, [
        "--ssl-certfile", str(server.cert), "--ssl-keyfile", str(server.key),
        "--ssl-ca-certs", str(pki["ca"].files.cert)], scheme="https",
        verify=client_context(pki["ca"], pki["client"]))
    yield gateway
    gateway.stop()


def fails(url: str, verify) -> str:
    """The error a client gets: it must get no answer at all."""
    try:
        response = httpx.get(url + "/health", verify=verify, timeout=10)
    except httpx.HTTPError as exc:
        return type(exc).__name__
    raise AssertionError(f"got {response.status_code} from {url}")


def test_plain_http_to_the_tls_port_gets_no_answer(tls):
    with Honest(tls):
        fails(f"http://127.0.0.1:{tls.port}", True)
        answer, closed = exchange(tls.port, HEALTH, timeout=5)
        assert b"HTTP/1.1 200" not in answer and closed


def test_a_client_that_does_not_trust_the_gateway_ca_refuses_it(tls, pki):
    with Honest(tls):
        assert fails(tls.url, client_context(pki["other"])) == "ConnectError"
        assert fails(tls.url, client_context(None)) == "ConnectError"  # the system's CAs
        assert fails(tls.url.replace("127.0.0.1", "localhost"),
                     client_context(pki["ca"])) == "ConnectError"  # not the certified name


def test_the_right_ca_works(tls, pki):
    with Honest(tls, loops=4, minimum=8):
        assert tls.get("/readiness").status_code == 200
    assert "TLS" in tls.proc.log() and "https://" in tls.proc.log()


def test_mtls_refuses_clients_without_a_certificate_of_its_ca(mtls, pki):
    with Honest(mtls):
        fails(mtls.url, client_context(pki["ca"]))  # no certificate
        fails(mtls.url, client_context(pki["ca"], pki["stranger"]))  # another CA's
        fails(mtls.url, client_context(pki["ca"], pki["impostor"]))  # a server cert of it
        fails(f"http://127.0.0.1:{mtls.port}", True)
    assert "TLS with client certificates" in mtls.proc.log()


def test_mtls_serves_clients_with_a_certificate_of_its_ca(mtls, pki):
    with Honest(mtls, loops=4, minimum=8):
        with httpx.Client(verify=client_context(pki["ca"], pki["client"])) as client:
            assert client.get(mtls.url + "/v1/models").status_code == 200


def test_tls_settings_are_checked_before_serving(pki, tmp_path):
    server = pki["server"]
    base = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    for args in (["--ssl-certfile", str(server.cert)],
                 ["--ssl-keyfile", str(server.key)],
                 ["--ssl-ca-certs", str(pki["ca"].files.cert)],
                 ["--ssl-certfile", str(tmp_path / "missing.pem"), "--ssl-keyfile",
                  str(server.key)]):
        with pytest.raises(ConfigError):
            load_config(base + args, environ={})
