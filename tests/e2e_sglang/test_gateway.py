"""The gateway in front of real SGLang PD servers on CPU that it launched itself."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e_sglang.conftest import SglangCluster

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]  # the first test pays the start-up

GREEDY = {"temperature": 0, "max_new_tokens": 12}
PROMPTS = ["the quick brown fox", "once upon a time there was", "hello world, this is"]


def post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url, json=body, timeout=timeout, trust_env=False)


def sse(text: str) -> list[dict]:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def test_generate_equals_plain_server(sglang_cluster: SglangCluster) -> None:
    for prompt in PROMPTS:
        body = {"text": prompt, "sampling_params": GREEDY}
        got = post(sglang_cluster.gateway + "/generate", body)
        want = post(sglang_cluster.null_url + "/generate", body).json()
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == want["output_ids"]
        assert got.json()["text"] == want["text"]


def test_generate_stream_batch_and_logprobs(sglang_cluster: SglangCluster) -> None:
    gw, plain = sglang_cluster.gateway, sglang_cluster.null_url
    stream = post(gw + "/generate", {"text": PROMPTS[0], "sampling_params": GREEDY,
                                     "stream": True})
    want = post(plain + "/generate", {"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    assert sse(stream.text)[-1]["text"] == want["text"]

    batch = post(gw + "/generate", {"text": PROMPTS, "sampling_params": GREEDY})
    assert batch.status_code == 200, batch.text
    want_batch = post(plain + "/generate", {"text": PROMPTS, "sampling_params": GREEDY}).json()
    assert [i["output_ids"] for i in batch.json()] == [i["output_ids"] for i in want_batch]

    body = {"text": PROMPTS[1], "sampling_params": GREEDY, "return_logprob": True,
            "logprob_start_len": 0}
    got = post(gw + "/generate", body).json()["meta_info"]
    ref = post(plain + "/generate", body).json()["meta_info"]
    assert [t[1] for t in got["input_token_logprobs"]] == [t[1] for t in ref["input_token_logprobs"]]
    assert len(got["output_token_logprobs"]) == GREEDY["max_new_tokens"]
    for a, b in zip(got["input_token_logprobs"][1:], ref["input_token_logprobs"][1:], strict=True):
        assert a[0] == pytest.approx(b[0], abs=0.05)


def test_a_batch_with_logprobs_per_prompt(sglang_cluster: SglangCluster) -> None:
    """`return_logprob` as one boolean per prompt (GenerateReqInput._normalize_logprob_params):
    the gateway refused the list with a 400 SGLang does not give."""
    body = {"text": PROMPTS[:2], "sampling_params": GREEDY, "return_logprob": [True, False],
            "logprob_start_len": 0}
    got = post(sglang_cluster.gateway + "/generate", body)
    want = post(sglang_cluster.null_url + "/generate", body).json()
    assert got.status_code == 200, got.text
    items = got.json()
    assert [i["output_ids"] for i in items] == [i["output_ids"] for i in want]
    for item, ref in zip(items, want, strict=True):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert (key in item["meta_info"]) == (key in ref["meta_info"]), key
            if key in ref["meta_info"]:
                assert [t[1] for t in item["meta_info"][key]] == \
                    [t[1] for t in ref["meta_info"][key]], key


def test_openai_endpoints_equal_plain_server(sglang_cluster: SglangCluster) -> None:
    gw = openai.OpenAI(base_url=sglang_cluster.gateway + "/v1", api_key="x", max_retries=0,
                       timeout=120)
    plain = openai.OpenAI(base_url=sglang_cluster.null_url + "/v1", api_key="x",
                          max_retries=0, timeout=120)
    model = sglang_cluster.model_name
    kwargs = {"model": model, "max_tokens": 10, "temperature": 0}
    got = gw.completions.create(prompt=PROMPTS[2], **kwargs)
    want = plain.completions.create(prompt=PROMPTS[2], **kwargs)
    assert got.choices[0].text == want.choices[0].text
    batch = gw.completions.create(prompt=PROMPTS, **kwargs)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2]
    streamed = "".join(c.choices[0].text for c in gw.completions.create(
        prompt=PROMPTS[2], stream=True, **kwargs) if c.choices)
    assert streamed == want.choices[0].text

    messages = [{"role": "user", "content": "Say something."}]
    chat = gw.chat.completions.create(messages=messages, **kwargs)
    ref = plain.chat.completions.create(messages=messages, **kwargs)
    assert chat.choices[0].message.content == ref.choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in gw.chat.completions.create(
        messages=messages, stream=True, **kwargs) if c.choices]
    assert "".join(pieces) == ref.choices[0].message.content


def _pids_of(port: int) -> list[int]:
    needle = f"--port\x00{port}\x00".encode()
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if needle in cmdline.read_bytes() and b"sglang.launch_server" in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_killed_prefill_fails_fast_then_recovers(sglang_cluster: SglangCluster) -> None:
    gw = sglang_cluster.gateway
    prefill = sglang_cluster.prefill[0]
    port = int(prefill.url.rsplit(":", 1)[1])
    pids = _pids_of(port)
    assert pids, "the launched prefill server was not found"

    async def load(stop_at: float) -> list[tuple[int, float]]:
        results = []
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            async def one(i: int) -> None:
                while time.monotonic() < stop_at:
                    t0 = time.monotonic()
                    try:
                        r = await client.post(gw + "/generate", json={
                            "text": f"load {i}", "sampling_params": {"max_new_tokens": 4}})
                        results.append((r.status_code, time.monotonic() - t0))
                    except httpx.HTTPError:
                        results.append((0, time.monotonic() - t0))
                    await asyncio.sleep(0.05)

            await asyncio.gather(*(one(i) for i in range(4)))
        return results

    async def scenario() -> list[tuple[int, float]]:
        task = asyncio.create_task(load(time.monotonic() + 25))
        await asyncio.sleep(5)
        os.killpg(os.getpgid(pids[0]), signal.SIGKILL)
        return await task

    results = asyncio.run(scenario())
    statuses = {s for s, _ in results}
    assert 200 in statuses
    assert 0 not in statuses, "a client connection failed instead of getting an answer"
    failures = [d for s, d in results if s != 200]
    assert failures, "killing the only prefill should fail some requests"
    assert all(s in (200, 502, 503, 504) for s in statuses), statuses
    # nothing hangs for SGLang's 300 s bootstrap timeout: the decode is cancelled at once
    assert max(d for _, d in results) < 30, sorted(d for _, d in results)[-5:]
    # the launcher restarts the prefill and traffic recovers
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        ready = httpx.get(gw + "/readiness", timeout=10, trust_env=False).status_code == 200
        if ready and post(gw + "/generate", {"text": "back?", "sampling_params": GREEDY},
                          timeout=60).status_code == 200:
            break
        time.sleep(2)
    else:
        pytest.fail("traffic did not recover after the prefill restart")
    assert _pids_of(port) and _pids_of(port) != pids
    # every decode takes KV from the new process, not only the one the gateway tried: a
    # prefill back before a decode's heartbeat dropped it leaves that decode sending to the
    # dead process for good (backends/launcher/heartbeat.py)
    for decode in range(len(sglang_cluster.decode)):
        body = {"text": f"after the restart, decode {decode}", "sampling_params": GREEDY}
        answers = asyncio.run(asyncio.wait_for(
            sglang_cluster.pd_generate(body, decode=decode), timeout=60))
        assert [a.status_code for a in answers] == [200, 200], sglang_cluster.decode[decode].url
