"""`--rate-limit-tokens` through a real gateway: what a key is charged, and what it gets back.

One gateway (`--max-concurrency 1 --max-queue 1 --rate-limit-tokens 600`) on the shared
simulators, one key per tenant. Until 2026-12-07 a request was charged before admission and
never refunded, so a flood of another tenant that kept the queue full made the victim's
refused requests (429 `queue_full`, never served) use up its budget: once the flood ended,
its next request was refused by its own token limit. Tool definitions and `n` went
uncharged."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.security.conftest import bearer
from tests.security.rig import start_gateway

ATTACKER, VICTIM = "sk-token-flood-0000000001", "sk-token-victim-000000002"
TOOLS_KEY, SAMPLES_KEY = "sk-token-tools-0000000003", "sk-token-samples-00000004"


@pytest.fixture(scope="module")
def limited(logs, sims):
    keys = logs / "token-limit-keys"
    keys.write_text(f"{ATTACKER} flooder\n{VICTIM} victim\n{TOOLS_KEY} tools\n"
                    f"{SAMPLES_KEY} samples\n", encoding="utf-8")
    gateway = start_gateway(logs, "token-limit", sims, [
        "--api-key-file", str(keys), "--max-concurrency", "1", "--max-queue", "1",
        "--rate-limit-tokens", "600"])
    yield gateway
    gateway.stop()


def generate(gateway, key: str, chars: int, new_tokens: int):
    with gateway.client(bearer(key)) as client:
        return client.post("/generate", json={
            "text": "x" * chars, "sampling_params": {"max_new_tokens": new_tokens}})


def test_a_flood_of_another_tenant_leaves_the_victims_token_budget(limited):
    """The flood fills the slot and the queue; the victim's 3 requests of ~190 tokens are
    refused `queue_full` and must not be charged: its next one is served."""
    with ThreadPoolExecutor(2) as pool:
        flood = [pool.submit(generate, limited, ATTACKER, 40, 150) for _ in range(2)]
        time.sleep(0.8)  # one holds the slot (1.5 s of tokens), one waits in the queue
        refused = [generate(limited, VICTIM, 760, 4) for _ in range(3)]
        assert [r.status_code for r in refused] == [429] * 3, [r.text for r in refused]
        assert all("queue" in r.json()["error"]["message"] for r in refused)
        assert [f.result().status_code for f in flood] == [200, 200]
    after = generate(limited, VICTIM, 760, 4)  # 191 tokens: 570 would have been spent
    assert after.status_code == 200, after.text


def test_tool_definitions_count_against_the_limit(limited):
    """~38 KB of tool descriptions (about 9,400 tokens by chars/4) passed a smaller limit."""
    tool = {"type": "function", "function": {
        "name": "search", "description": "describe the tool " * 2100,
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
    with limited.client(bearer(TOOLS_KEY)) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
            "max_tokens": 4})
    assert r.status_code == 429, r.text
    assert "per minute" in r.json()["error"]["message"]


def test_n_samples_are_charged_per_sample(limited):
    """A 401-token prompt with n = 20 was charged 401, not 8,020."""
    with limited.client(bearer(SAMPLES_KEY)) as client:
        r = client.post("/v1/completions", json={"prompt": "y" * 1600, "n": 20,
                                                 "max_tokens": 2})
    assert r.status_code == 429, r.text
    assert "x 20 samples" in r.json()["error"]["message"]
