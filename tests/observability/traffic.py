"""A small, bounded mix of traffic that makes every gateway metric move.

Streaming and non-streaming requests on the three endpoints (repeated prompts, so the
prefix cache hits), a bad request, retries and a 502 through the simulator's error
fault, a client that leaves mid-stream, and a burst over the admission limit (queue time
and 429s). The gateway must run with a small admission limit (ADMISSION_ARGS).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

ADMISSION_ARGS = ["--max-concurrency", "2", "--max-queue", "2", "--queue-timeout", "10"]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
BURST = 10
TIMEOUT = 30.0


def generate(text: str = PROMPT, max_new_tokens: int = 8, stream: bool = False) -> dict:
    return {"text": text, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}


def chat(stream: bool) -> dict:
    return {"model": "sim-model", "stream": stream, "max_tokens": 8,
            "messages": [{"role": "user", "content": PROMPT}]}


def _post(client: httpx.Client, path: str, body: dict) -> int:
    """Send one request and read the whole answer (streamed or not); the status."""
    with client.stream("POST", path, json=body) as response:
        for _ in response.iter_bytes():
            pass
        return response.status_code


def _set_faults(urls: list[str], error_rate: float) -> None:
    for url in urls:
        httpx.post(url + "/sim/faults", json={"error_rate": error_rate},
                   timeout=5).raise_for_status()


def _leave_mid_stream(client: httpx.Client) -> None:
    """Start a long stream, read its first chunk and hang up (a 499 at the gateway)."""
    with client.stream("POST", "/generate",
                       json=generate(max_new_tokens=2000, stream=True)) as response:
        for _ in response.iter_bytes():
            break


def mixed_traffic(cluster) -> Counter:
    """One round of everything; the count of answers by status (499: we hung up)."""
    statuses: Counter = Counter()
    with httpx.Client(base_url=cluster.gateway, timeout=TIMEOUT) as client:
        for stream in (False, True, False, True):
            statuses[_post(client, "/generate", generate(stream=stream))] += 1
        for stream in (False, True):
            statuses[_post(client, "/v1/chat/completions", chat(stream))] += 1
        statuses[_post(client, "/v1/completions",
                       {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8})] += 1
        bad = client.post("/generate", content=b"{not json",
                          headers={"content-type": "application/json"})
        statuses[bad.status_code] += 1

        decode = cluster.decode
        try:
            _set_faults(decode[:1], 1.0)  # decode0 fails: retried on decode1
            for _ in range(3):
                statuses[_post(client, "/generate", generate(max_new_tokens=4))] += 1
            _set_faults(decode, 1.0)  # every decode fails: 502 after the retries
            statuses[_post(client, "/generate", generate(max_new_tokens=4))] += 1
        finally:
            _set_faults(decode, 0.0)

        _leave_mid_stream(client)
        statuses[499] += 1

        with ThreadPoolExecutor(BURST) as pool:
            burst = [pool.submit(_post, client, "/generate",
                                 generate(max_new_tokens=24, stream=True))
                     for _ in range(BURST)]
            for future in burst:
                with contextlib.suppress(httpx.HTTPError):
                    statuses[future.result()] += 1
    return statuses
