"""Fixtures of the security suite: simulated servers behind wire taps, and gateways.

* `sims`: one prefill and one decode simulator at 10 ms per token (a 300-token stream lasts
  3 s, an honest 4-token request a few tens of ms), shared by most gateways.
* `keyed`: the gateway with its DEFAULT flags and API keys the way production gives them:
  inference keys from a file (`--api-key-file`), the admin key from the environment
  (`GATEWAY_ADMIN_API_KEYS`); never on the command line. One inference key is not ASCII.
  Right after it starts, an idle connection is opened to it, so a test can check later that
  the default head deadline (10 s) closed it, without waiting 10 s of its own.
* `fast_sims` + `fast`: servers at 2 ms per token and a gateway with short deadlines
  (`--head-timeout 1 --body-timeout 1 --send-timeout 1`), for the slowloris attacks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.security.honest import connect, read_until_closed
from tests.security.rig import Gateway, Sims, start_gateway, start_sims

INFERENCE_KEY_A = "sk-inference-alpha-0123456789"
INFERENCE_KEY_B = "sk-inference-bravo-9876543210"
UNICODE_KEY = "sk-clé-ünïcode-ключ"  # UTF-8 on the wire
ADMIN_KEY = "sk-admin-charlie-5555555555"


def bearer(key: str) -> dict:
    return {"authorization": b"Bearer " + key.encode()}


class IdleProbe(threading.Thread):
    """One connection that never sends a byte; `closed_after` is set when the server hung up."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock = connect(port)
        self.opened = time.monotonic()
        self.closed_after: float | None = None

    def run(self) -> None:
        _, closed = read_until_closed(self.sock, 40)
        if closed:
            self.closed_after = time.monotonic() - self.opened
        self.sock.close()


@pytest.fixture(scope="session")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("security")


@pytest.fixture(scope="session")
def sims(logs) -> Iterator[Sims]:
    cluster = start_sims(logs, "main", token_delay=0.01)
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def fast_sims(logs) -> Iterator[Sims]:
    cluster = start_sims(logs, "fast", token_delay=0.002)
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def key_file(logs):
    path = logs / "api-keys"
    path.write_text(f"# inference keys\n{INFERENCE_KEY_A}\n{INFERENCE_KEY_B}\n{UNICODE_KEY}\n",
                    encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def keyed(logs, sims, key_file) -> Iterator[Gateway]:
    gateway = start_gateway(logs, "keyed", sims, ["--api-key-file", str(key_file)],
                            env={"GATEWAY_ADMIN_API_KEYS": ADMIN_KEY},
                            headers=bearer(UNICODE_KEY), admin_headers=bearer(ADMIN_KEY))
    gateway.idle_probe = IdleProbe(gateway.port)
    gateway.idle_probe.start()
    yield gateway
    gateway.stop()


FAST_ARGS = ("--head-timeout", "1", "--body-timeout", "1", "--send-timeout", "1")


@pytest.fixture(scope="session")
def fast(logs, fast_sims) -> Iterator[Gateway]:
    gateway = start_gateway(logs, "fast", fast_sims, FAST_ARGS)
    yield gateway
    gateway.stop()
