"""Usage accounting and the access log against real processes: the gateway with two tenants'
keys in front of the simulated cluster (1 prefill + 2 decode) on loopback.

Every request's own answer says what it cost (meta_info, or usage); the gateway's figures per
tenant (/admin/usage, /metrics) and its access log must say the same, and an OpenAI stream
whose client did not ask for usage must reach it without the usage event the gateway read.
A third tenant's clients leave their streams early: each still pays for what it got.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import orjson
import pytest

from tests.integration.conftest import sim_cluster

KEYS = {"acme": "key-acme-0123456789", "beta": "key-beta-0123456789"}
LEAVER, LEAVER_KEY = "gamma", "key-gamma-0123456789"  # the streams its clients leave
ADMIN = "admin-key-0123456789"
PROMPT = "A prompt about lighthouses, repeated so the prefix cache has something to hit. " * 3
SECRET_WORD = "lighthouses"  # in every prompt: it must never reach the access log


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    home = tmp_path_factory.mktemp("usage")
    (home / "keys").write_text("".join(f"{key} {name}\n" for name, key in
                                       (*KEYS.items(), (LEAVER, LEAVER_KEY))))
    (home / "admin").write_text(ADMIN + "\n")
    log = home / "access.log"
    args = ["--api-key-file", str(home / "keys"), "--admin-api-key-file", str(home / "admin"),
            "--access-log", str(log)]
    with sim_cluster(home, gateway_args=args) as cluster:
        yield cluster, log


def sse_objects(raw: bytes) -> list[dict]:
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]", events[-3:]
    return [orjson.loads(e[len(b"data: "):]) for e in events[:-1]]


class Tally:
    """What the clients were told, per tenant."""

    def __init__(self) -> None:
        self.figures: dict[str, Counter] = {name: Counter() for name in (*KEYS, "anonymous")}

    def add(self, tenant: str, prompt: int, cached: int, completion: int) -> None:
        self.figures[tenant].update(prompt_tokens=prompt, cached_tokens=cached,
                                    completion_tokens=completion)

    def native(self, tenant: str, items: list[dict]) -> None:
        for item in items:
            meta = item["meta_info"]
            self.add(tenant, meta["prompt_tokens"], meta["cached_tokens"],
                     meta["completion_tokens"])

    def openai(self, tenant: str, usage: dict) -> None:
        self.add(tenant, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                 usage["completion_tokens"])


def final_per_index(objects: list[dict]) -> list[dict]:
    last: dict[int, dict] = {}
    for obj in objects:
        last[obj.get("index", 0)] = obj
    return list(last.values())


def traffic(gateway: str) -> tuple[Tally, Counter]:
    tally, statuses = Tally(), Counter()
    chat = {"model": "sim-model", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": PROMPT}]}
    with httpx.Client(base_url=gateway, timeout=30) as client:
        def post(tenant: str, path: str, body: dict) -> httpx.Response:
            headers = {"authorization": f"Bearer {KEYS[tenant]}"} if tenant in KEYS else {}
            r = client.post(path, json=body, headers=headers)
            statuses[(tenant, r.status_code)] += 1
            return r

        generate = {"text": PROMPT, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
        for _ in range(2):  # the second finds the prompt cached
            tally.native("acme", [post("acme", "/generate", generate).json()])
        r = post("acme", "/generate", {**generate, "stream": True})
        tally.native("acme", final_per_index(sse_objects(r.content)))
        r = post("acme", "/generate", {**generate, "text": [PROMPT, PROMPT + " two"],
                                       "stream": True})
        tally.native("acme", final_per_index(sse_objects(r.content)))

        asked = post("beta", "/v1/chat/completions",
                     {**chat, "stream": True, "stream_options": {"include_usage": True}})
        usage = sse_objects(asked.content)[-1]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
        tally.openai("beta", usage["usage"])
        plain = post("beta", "/v1/chat/completions", {**chat, "stream": True})
        objects = sse_objects(plain.content)
        assert all(obj.get("usage") is None and obj["choices"] for obj in objects), objects[-2:]
        assert [o["choices"] for o in objects] == [o["choices"] for o in
                                                  sse_objects(asked.content)[:-1]]
        again = post("beta", "/v1/chat/completions",  # what `plain` found cached, too
                     {**chat, "stream": True, "stream_options": {"include_usage": True}})
        tally.openai("beta", sse_objects(again.content)[-1]["usage"])
        tally.openai("beta", sse_objects(again.content)[-1]["usage"])  # greedy: `plain` too
        declined = post("beta", "/v1/chat/completions",  # counted all the same (was not)
                        {**chat, "stream": True, "stream_options": {"include_usage": False}})
        assert all(obj.get("usage") is None for obj in sse_objects(declined.content))
        tally.openai("beta", sse_objects(again.content)[-1]["usage"])  # the same, greedy
        tally.openai("beta", post("beta", "/v1/completions",
                                  {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4})
                     .json()["usage"])

        assert post("beta", "/generate", {"text": 5}).status_code == 400
        assert post("anonymous", "/generate", generate).status_code == 401
    return tally, statuses


def admin(cluster, path: str) -> httpx.Response:
    return httpx.get(cluster.gateway + path, headers={"authorization": f"Bearer {ADMIN}"},
                     timeout=10)


def settled_usage(cluster) -> dict:
    """/admin/usage once two reads 0.5 s apart agree (prefill answers may trail the decode)."""
    deadline = time.monotonic() + 15
    last = admin(cluster, "/admin/usage").json()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = admin(cluster, "/admin/usage").json()
        if now == last:
            return now
        last = now
    raise AssertionError("usage did not settle")


@pytest.fixture(scope="module")
def served(tenants):
    cluster, log = tenants
    tally, statuses = traffic(cluster.gateway)
    return cluster, log, tally, statuses, settled_usage(cluster)


def test_each_tenant_is_counted_as_its_answers_said(served):
    cluster, _, tally, statuses, report = served
    for tenant in KEYS:
        total = report["tenants"][tenant]["models"]["sim-model"]
        told = tally.figures[tenant]
        assert told["cached_tokens"] > 0, "the repeated prompt should have hit the cache"
        assert total["prompt_tokens"] == told["prompt_tokens"], tenant
        assert total["cached_tokens"] == told["cached_tokens"], tenant
        assert total["uncached_tokens"] == told["prompt_tokens"] - told["cached_tokens"]
        assert total["completion_tokens"] == told["completion_tokens"], tenant
        assert total["requests"] == sum(n for (t, _), n in statuses.items() if t == tenant)
    assert report["tenants"]["beta"]["total"]["errors_4xx"] == 1
    assert report["tenants"]["acme"]["total"]["errors_4xx"] == 0
    assert report["tenants"]["anonymous"]["total"]["errors_4xx"] == 1  # the 401


def test_metrics_show_the_same_figures_and_add_up_to_the_servers(served):
    cluster, _, _, _, report = served
    text = httpx.get(cluster.gateway + "/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line.startswith(("gateway_tenant_tokens_total{", "gateway_prompt_tokens_total{")):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    acme = report["tenants"]["acme"]["models"]["sim-model"]
    key = 'gateway_tenant_tokens_total{kind="%s",model="sim-model",tenant="acme"}'
    assert samples[key % "completion"] == acme["completion_tokens"]
    assert samples[key % "cached"] == acme["cached_tokens"]
    by_server = sum(v for k, v in samples.items() if k.startswith("gateway_prompt_tokens"))
    by_tenant = sum(v for k, v in samples.items()
                    if k.startswith("gateway_tenant") and 'kind="completion"' not in k)
    assert by_server == by_tenant == report["total"]["prompt_tokens"]


def test_the_access_log_has_one_line_per_request_and_no_secrets(served):
    _, log, _, statuses, report = served
    text = log.read_text()
    lines = [x for line in text.splitlines() if (x := json.loads(line))["tenant"] != LEAVER]
    assert len(lines) == sum(statuses.values())
    assert Counter((x["tenant"], x["status"]) for x in lines) == statuses
    for tenant in KEYS:
        mine = [x for x in lines if x["tenant"] == tenant]
        total = report["tenants"][tenant]["total"]
        for field in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            assert sum(x[field] or 0 for x in mine) == total[field], (tenant, field)
    ok = [x for x in lines if x["status"] == 200]
    assert all(x["prefill"] and x["decode"] and x["attempts"] >= 1 for x in ok)
    assert all(0 < x["ttft_s"] <= x["duration_s"] for x in ok)
    assert {x["endpoint"] for x in ok} == {"generate", "chat", "completions"}
    for secret in (*KEYS.values(), ADMIN, SECRET_WORD):
        assert secret not in text


def test_usage_needs_the_admin_key(served):
    cluster = served[0]
    assert httpx.get(cluster.gateway + "/admin/usage", timeout=10).status_code == 401
    as_tenant = httpx.get(cluster.gateway + "/admin/usage", timeout=10,
                          headers={"authorization": f"Bearer {KEYS['acme']}"})
    assert as_tenant.status_code == 403


# -- streams their clients leave (metering: what the client got is paid for) --------------

LONG = 400  # tokens asked for: a few seconds of the sim's decode, left long before the end
LEFT_AFTER = 10  # events with text the client reads before it leaves
CUT = {
    "chat": ("/v1/chat/completions", {"model": "sim-model", "max_tokens": LONG, "stream": True,
                                      "messages": [{"role": "user", "content": PROMPT}]}),
    "chat-n2": ("/v1/chat/completions", {"model": "sim-model", "max_tokens": LONG, "n": 2,
                                         "stream": True, "temperature": 0,
                                         "messages": [{"role": "user", "content": PROMPT}]}),
    "completions": ("/v1/completions", {"model": "sim-model", "prompt": PROMPT,
                                        "max_tokens": LONG, "stream": True}),
}


def leaver_usage(cluster) -> dict:
    return settled_usage(cluster)["tenants"].get(LEAVER, {}).get("total", {})


def generated(cluster) -> float:
    """Tokens the decode servers generated so far (`sglang:generation_tokens_total`)."""
    total = 0.0
    for url in cluster.decode:
        for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("sglang:generation_tokens_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def has_text(obj: dict) -> bool:
    choice = (obj.get("choices") or [{}])[0]
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


def read_then_leave(gateway: str, path: str, body: dict) -> int:
    """Read a stream until LEFT_AFTER events with text came, then close the connection:
    how many came."""
    got = 0
    with httpx.Client(base_url=gateway, timeout=30) as client, client.stream(
            "POST", path, json=body, headers={"authorization": f"Bearer {LEAVER_KEY}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                obj = orjson.loads(line[len("data: "):])
                assert "usage" not in obj or obj["usage"] is None, obj
                got += has_text(obj)
                if got >= LEFT_AFTER:
                    break
    return got


@pytest.mark.parametrize("kind", list(CUT))
def test_a_client_that_leaves_mid_stream_pays_for_what_it_got(tenants, kind):
    """The client reads 10 events with text and leaves. Its OpenAI stream never had its usage
    event (the decode's last), so it counted 0 completion tokens: a long answer cut just
    before its end was free. Now it counts at least the events with text the client got,
    and no more than the decode servers generated for it."""
    cluster, _ = tenants
    path, body = CUT[kind]
    before, made = leaver_usage(cluster), generated(cluster)
    got = read_then_leave(cluster.gateway, path, body)
    deadline = time.monotonic() + 15
    while leaver_usage(cluster).get("requests", 0) < before.get("requests", 0) + 1 or \
            any(cluster.stats(u)["in_flight"] for u in cluster.decode):  # its decodes stopped
        assert time.monotonic() < deadline, "the request never ended"
    counted = leaver_usage(cluster)["completion_tokens"] - before.get("completion_tokens", 0)
    assert got == LEFT_AFTER
    assert got <= counted <= generated(cluster) - made < LONG * body.get("n", 1), (got, counted)


def test_a_whole_stream_still_counts_its_usage_event_exactly(tenants):
    cluster, _ = tenants
    path, body = CUT["chat"]
    before = leaver_usage(cluster).get("completion_tokens", 0)
    r = httpx.post(cluster.gateway + path, timeout=30,
                   json={**body, "max_tokens": 12, "stream_options": {"include_usage": True}},
                   headers={"authorization": f"Bearer {LEAVER_KEY}"})
    usage = sse_objects(r.content)[-1]["usage"]
    assert usage["completion_tokens"] == 12
    assert leaver_usage(cluster)["completion_tokens"] - before == 12
