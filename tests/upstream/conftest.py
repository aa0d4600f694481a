"""Fixtures of the socket-level client tests: the client kind, and TLS material."""

from __future__ import annotations

import pytest

from tests.upstream.raw import CLIENTS, Certs, make_certs


@pytest.fixture(params=CLIENTS)
def kind(request) -> str:
    """Each test runs against every data-path client with its own socket code: the built-in
    one ("fast", the default) and aiohttp's."""
    return request.param


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("tls"))
