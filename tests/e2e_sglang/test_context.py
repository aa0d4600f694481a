"""The pre-dispatch context check (gateway/tokens/context_check.py) against real SGLang 0.5.23
PD servers on CPU, at the tiny model's context length (2,048 tokens).

SGLang refuses a prompt of `context_len` tokens or more, and a prompt whose tokens plus
`max_new_tokens` pass it (`TokenizerManager._validate_one_request`); its scheduler refuses a
prompt of `max_req_input_len` tokens or more (`validate_input_length`: the context less 6 here),
the tighter bound, which this test found the gateway did not know. The gateway refuses
exactly those prompts, before either leg is sent, with a 400 `context_length_exceeded`, whether
it counts them with the servers' tokenizer read here or, where that file is not readable here,
with a server's `/v1/tokenize`: each prompt at the limit is sent to the gateway and to the
plain reference server, and the answers must agree. A `/v1/responses` chain is counted as the
chat SGLang makes of it: served to the last turn that fits, then refused with a 400, where it
used to get 503 "retry shortly" past half the context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e_sglang.conftest import SglangCluster
from tests.procs import HOST, free_port, python, running
from tests.rigs.faults import wait_until

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

NO_TOKENIZER = "no tokenizer: prompt tokens are estimated"  # the gateway's log, without one


@contextlib.contextmanager
def counting_gateway(cluster: SglangCluster, tokenizer_here: bool) -> Iterator[str]:
    """A gateway on the cluster's servers. Without `tokenizer_here`, the model's directory
    (the tokenizer path the servers report) is moved away while the gateway starts, so that
    it counts with a server's /v1/tokenize; the servers loaded theirs long before."""
    port = free_port()
    argv = python("-m", "gateway", "--host", HOST, "--port", str(port), "--log-level", "info")
    for server in cluster.prefill:
        argv += ["--prefill", server.url, str(server.bootstrap_port)]
    for server in cluster.decode:
        argv += ["--decode", server.url]
    url = f"http://{HOST}:{port}"
    model, hidden = cluster.model_path, cluster.model_path.with_name("hidden-model")
    if not tokenizer_here:
        model.rename(hidden)
    try:
        with running(f"gateway-context-{tokenizer_here}", argv, cluster.log_dir,
                     url + "/readiness", timeout=120) as proc:
            if not tokenizer_here:
                wait_until(lambda: NO_TOKENIZER in proc.log(), 30, "the tokenizer was missed")
                hidden.rename(model)
            else:
                assert NO_TOKENIZER not in proc.log()
            yield url
    finally:
        if hidden.exists():
            hidden.rename(model)


def tokens(cluster: SglangCluster, text: str) -> int:
    """The prompt's tokens as the plain server counts a completion's prompt."""
    answer = httpx.post(cluster.null_url + "/v1/tokenize", timeout=60,
                        json={"model": cluster.model_name, "prompt": text})
    answer.raise_for_status()
    return answer.json()["count"]


def prompt_of(cluster: SglangCluster, count: int) -> str:
    """A text prompt of exactly `count` tokens (the plain server's count)."""
    words = count
    for _ in range(8):
        text = "once" + " the" * words  # " the": one token of the tiny model's
        have = tokens(cluster, text)
        if have == count:
            return text
        words += count - have
    raise AssertionError(f"no prompt of {count} tokens found")


def text_of(content: str | list) -> str:
    """An input or output item's text (a string, or a list of text parts)."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def status(url: str, model: str, prompt: str, max_tokens: int) -> tuple[int, str]:
    answer = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    body = answer.json()
    error = body.get("error", body) if answer.status_code >= 400 else None
    if not isinstance(error, dict):
        return answer.status_code, str(error)
    return answer.status_code, str(error.get("code")) + " " + str(error.get("message"))[:300]


@pytest.mark.parametrize("tokenizer_here", [True, False], ids=["own-tokenizer", "server-count"])
def test_prompts_at_the_limit_are_refused_where_sglang_refuses_them(
        sglang_cluster: SglangCluster, tokenizer_here: bool) -> None:
    cluster = sglang_cluster
    context = httpx.get(cluster.null_url + "/v1/models", timeout=30).json()["data"][0][
        "max_model_len"]
    bound = httpx.get(cluster.null_url + "/server_info", timeout=30).json()["max_req_input_len"]
    assert bound < context  # the scheduler's bound is the tighter one (the context less 6)
    room = context - (bound - 1)  # new tokens that still fit after the longest prompt
    cases = [(bound - 1, room), (bound - 1, room + 1), (bound, 1), (context - 1, 1)]
    served = []
    with counting_gateway(cluster, tokenizer_here) as url:
        for count, new in cases:
            prompt = prompt_of(cluster, count)
            plain = status(cluster.null_url, cluster.model_name, prompt, new)
            ours = status(url, cluster.model_name, prompt, new)
            assert plain[0] in (200, 400), plain
            assert ours[0] == plain[0], (count, new, ours, plain)
            if ours[0] == 400:
                assert ours[1].startswith("context_length_exceeded"), (count, new, ours, plain)
            else:
                served.append((count, new))
        metrics = httpx.get(url + "/metrics", timeout=30).text
    assert served == [(bound - 1, room)], served  # the rules themselves
    dispatched = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("gateway_routing_decisions_total")
                     and 'role="prefill"' in line)
    assert dispatched == len(served), "a prompt that does not fit was sent to the servers"


def test_a_responses_chain_is_served_until_it_no_longer_fits(
        sglang_cluster: SglangCluster) -> None:
    """Counted by a server's /v1/tokenize (the harder path: no tokenizer here)."""
    cluster = sglang_cluster
    question = "Tell me more about it, and then " + "more " * 150
    with counting_gateway(cluster, tokenizer_here=False) as url:
        previous, used, refusal = None, [], None
        for _ in range(20):
            answer = httpx.post(url + "/v1/responses", timeout=300, json={
                "model": cluster.model_name, "input": question, "temperature": 0,
                "max_output_tokens": 8, "previous_response_id": previous})
            if answer.status_code != 200:
                refusal = answer
                break
            turn = answer.json()
            used.append(turn["usage"]["input_tokens"])
            previous = turn["id"]
        items = httpx.get(f"{url}/v1/responses/{previous}/input_items?order=asc&limit=100",
                          timeout=30).json()["data"]
    assert refusal is not None and len(used) >= 3, used
    assert refusal.status_code == 400, refusal.text  # never 503 "retry shortly"
    assert refusal.json()["error"]["code"] == "context_length_exceeded", refusal.text
    assert used == sorted(used) and used[-1] + 8 <= 2048, used  # the tiny model's context
    # the turn refused, as the chat it is, is refused by a plain SGLang server too
    messages = [{"role": item["role"], "content": text_of(item["content"])} for item in items]
    messages += [{"role": "assistant", "content": text_of(turn["output"][0]["content"])},
                 {"role": "user", "content": question}]
    plain = httpx.post(cluster.null_url + "/v1/chat/completions", timeout=300, json={
        "model": cluster.model_name, "messages": messages, "max_tokens": 8, "temperature": 0})
    assert plain.status_code == 400, plain.text[:300]
