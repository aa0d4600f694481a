"""Costly endpoints: a burst of callers costs the servers one computation per cache TTL.

`/health_generate` is open to anyone (probes) and runs a real PD generation; `/server_info`
and `/v1/models` ask the servers. The wire taps count what the servers received: the
gateway's own health generations carry an `x-request-id` starting with `probe-`, so honest
traffic beside the burst does not blur the count.
"""

from __future__ import annotations

import concurrent.futures
import time

from gateway.config.settings import GatewayConfig
from tests.security.conftest import bearer
from tests.security.honest import Honest

BURST = 20


def burst(gateway, path: str, headers=None) -> list[int]:
    """BURST callers at once (one connection each, from one thread-safe client)."""
    with gateway.client() as client, concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(lambda _: client.get(path, headers=headers).status_code,
                             range(BURST)))


def probes(sims, since: float) -> int:
    return sum(1 for s in sims.decode.tap.seen("/generate", since)
               if (s.header("x-request-id") or "").startswith("probe-"))


def test_a_health_generate_burst_costs_one_generation(keyed, sims):
    assert GatewayConfig().info_cache_ttl == 5.0
    since = time.monotonic()
    with Honest(keyed):
        first = burst(keyed, "/health_generate")  # anonymous, as a probe
        second = burst(keyed, "/health_generate", bearer("sk-wrong"))
    assert first == second == [200] * BURST
    assert 1 <= probes(sims, since) <= 2, probes(sims, since)
    assert len(sims.prefill.tap.seen("/generate", since)) >= probes(sims, since)


def test_info_bursts_cost_one_request_per_server(keyed, sims):
    since = time.monotonic()
    with Honest(keyed):
        for path in ("/server_info", "/get_server_info", "/v1/models", "/model_info"):
            assert burst(keyed, path, keyed.headers) == [200] * BURST, path
            assert set(burst(keyed, path)) == {401}, path  # and nothing for strangers
    for sim in sims.both:
        asked = [s.path for s in sim.tap.seen(since=since) if s.method == "GET"
                 and s.path in ("/server_info", "/get_server_info", "/v1/models", "/model_info")]
        assert asked.count("/server_info") <= 2, asked
        assert asked.count("/v1/models") <= 2 and asked.count("/model_info") <= 2, asked


def test_server_info_redacts_secrets_but_keeps_the_figures(keyed):
    info = keyed.get("/server_info", keyed.headers).json()
    decode = info["decode"][0]
    for name in ("max_total_num_tokens", "max_total_tokens", "tokenizer_path",
                 "skip_tokenizer_init", "context_length"):
        assert name in decode and decode[name] != "<redacted>", (name, decode.get(name))
    assert isinstance(decode["max_total_num_tokens"], int)
    assert info["gateway"]["replica_id"] is not None
