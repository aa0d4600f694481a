"""Several models behind one real gateway process, in front of simulated servers of each model
(`python -m backends.sim --model-path ... [--served-model-name ...]`, as SGLang's flags),
loopback only: routing by `model`, aliases, 404 and 400 in OpenAI's shape, /v1/models,
per-model policies and prefix state, usage counted per model, the default model, a server
whose model is known only once it answers, a single-model gateway that stays lenient, and
`--launch` with a two-model topology.
"""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from tests.integration.conftest import sim
from tests.procs import HOST, ROOT, free_port, python, running

ALIASES = json.dumps({"fast": "beta"})
POLICIES = json.dumps({"beta": {"decode_policy": "round_robin",
                                "policy_options": {"cache_aware": {"match_threshold": 0.9}}}})


def chat(model: str | None, text: str = "hello there") -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return body if model is None else {**body, "model": model}


# how each model's servers are started: alpha by its path alone (SGLang then serves it under
# that path), beta from a path with its own served name (the name wins)
NAMING = {"beta": ["--model-path", "/models/beta-7b-instruct", "--served-model-name", "beta"]}


def start_sims(stack, log_dir, layout: dict[str, tuple[int, int]]) -> dict[str, dict]:
    """{model: (prefills, decodes)} -> {model: {"prefill": [(url, boot)], "decode": [url]}}."""
    out: dict[str, dict] = {}
    for model, (n_prefill, n_decode) in layout.items():
        servers: dict[str, list] = {"prefill": [], "decode": []}
        for role, count in (("prefill", n_prefill), ("decode", n_decode)):
            for i in range(count):
                port, boot = free_port(), free_port() if role == "prefill" else None
                url = f"http://{HOST}:{port}"
                naming = NAMING.get(model, ["--model-path", model])
                stack.enter_context(running(f"{model}-{role}{i}", sim(
                    role, port, boot, *naming, "--fast"), log_dir, url + "/health"))
                servers[role].append((url, boot) if role == "prefill" else url)
        out[model] = servers
    return out


def gateway_argv(port: int, sims: dict[str, dict], *extra: str) -> list[str]:
    argv = python("-m", "gateway", "--host", HOST, "--port", str(port), "--health-interval",
                  "0.3")
    for servers in sims.values():
        for url, boot in servers["prefill"]:
            argv += ["--prefill", url, str(boot)]
        for url in servers["decode"]:
            argv += ["--decode", url]
    return argv + list(extra)


@contextlib.contextmanager
def gateway(log_dir, sims, *extra: str, name: str = "gateway", ready: str = "/readiness"):
    port = free_port()
    url = f"http://{HOST}:{port}"
    with running(name, gateway_argv(port, sims, *extra), log_dir, url + ready):
        yield url


def received(url: str) -> int:
    return httpx.get(url + "/sim/stats", timeout=5).json()["received"]


def urls(servers: dict) -> list[str]:
    return [u for u, _ in servers["prefill"]] + servers["decode"]


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """alpha: 2 prefill + 1 decode, beta: 1 + 1; a gateway with an alias and beta's own
    policy settings (no default model)."""
    log_dir = tmp_path_factory.mktemp("logs")
    with contextlib.ExitStack() as stack:
        sims = start_sims(stack, log_dir, {"alpha": (2, 1), "beta": (1, 1)})
        url = stack.enter_context(gateway(
            log_dir, sims, "--model-aliases", ALIASES, "--model-policies", POLICIES,
            "--policy-options", json.dumps({"cache_aware": {"match_threshold": 0.5}})))
        yield url, sims, log_dir


def test_model_field_picks_the_pool_and_aliases_rewrite_upstream(rig):
    gw, sims, _ = rig
    before = {u: received(u) for servers in sims.values() for u in urls(servers)}
    for model, count in (("alpha", 4), ("beta", 3), ("fast", 2), ("alpha:my-adapter", 1)):
        for i in range(count):
            r = httpx.post(gw + "/v1/chat/completions", json=chat(model, f"prompt {i}"),
                           timeout=30)
            assert r.status_code == 200, r.text
            # an alias reaches the servers as its model's name (SGLang echoes it back)
            assert r.json()["model"] == {"fast": "beta"}.get(model, model)
    delta = {u: received(u) - n for u, n in before.items()}
    alpha, beta = sims["alpha"], sims["beta"]
    assert sum(delta[u] for u, _ in alpha["prefill"]) == 5 and delta[alpha["decode"][0]] == 5
    assert delta[beta["prefill"][0][0]] == 5 and delta[beta["decode"][0]] == 5


def test_unknown_model_is_404_and_no_model_is_400_naming_the_models(rig):
    gw, sims, _ = rig
    before = {u: received(u) for servers in sims.values() for u in urls(servers)}
    r = httpx.post(gw + "/v1/chat/completions", json=chat("gpt-5"), timeout=30)
    assert r.status_code == 404
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "model_not_found", "model")
    assert "'gpt-5'" in error["message"] and "alpha, beta" in error["message"]
    for body in (chat(None), chat("default")):
        r = httpx.post(gw + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_required"
        assert "alpha, beta" in r.json()["error"]["message"]
    r = httpx.post(gw + "/generate", json={"text": "x", "model": "nope"}, timeout=30)
    assert r.status_code == 404  # the native API routes by `model` too
    assert {u: received(u) for u in before} == before  # nothing reached a server


def test_v1_models_lists_each_model_once_with_its_aliases(rig):
    gw, _, _ = rig
    body = httpx.get(gw + "/v1/models", timeout=30).json()
    assert body["object"] == "list"
    cards = {c["id"]: c for c in body["data"]}
    assert [c["id"] for c in body["data"]] == ["alpha", "beta", "fast"]
    assert all(c["object"] == "model" and c["max_model_len"] > 0 for c in body["data"])
    assert cards["fast"]["root"] == "beta"
    assert httpx.get(gw + "/v1/models/fast", timeout=30).json()["root"] == "beta"
    missing = httpx.get(gw + "/v1/models/nope", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    info = httpx.get(gw + "/model_info", params={"model": "fast"}, timeout=30).json()
    assert info["served_model_name"] == "beta"
    assert httpx.get(gw + "/model_info", params={"model": "nope"}, timeout=30).status_code == 404


def test_each_model_has_its_own_policies_and_prefix_state(rig):
    gw, sims, _ = rig
    prompt = "the same long prompt sent to both models, so both trees learn it"
    for model in ("alpha", "beta", "alpha", "beta"):
        assert httpx.post(gw + "/v1/chat/completions", json=chat(model, prompt),
                          timeout=30).status_code == 200
    policies = httpx.get(gw + "/admin/policies", timeout=30).json()["models"]
    alpha, beta = policies["alpha"], policies["beta"]
    assert (alpha["prefill"]["name"], alpha["decode"]["name"]) == ("auto", "auto")
    assert (beta["prefill"]["name"], beta["decode"]["name"]) == ("auto", "round_robin")
    assert alpha["prefill"]["options"]["match_threshold"] == 0.5  # the global options
    assert beta["prefill"]["options"]["match_threshold"] == 0.9  # its own
    alpha_tree = set(alpha["prefill"]["stats"]["tree_size_by_worker"])
    beta_tree = set(beta["prefill"]["stats"]["tree_size_by_worker"])
    assert alpha_tree and alpha_tree <= {u for u, _ in sims["alpha"]["prefill"]}
    assert beta_tree == {sims["beta"]["prefill"][0][0]}


def usage_by_model(gw: str) -> dict[str, dict]:
    """/admin/usage's figures per model, summed over tenants."""
    out: dict[str, dict] = {}
    for entry in httpx.get(gw + "/admin/usage", timeout=30).json()["tenants"].values():
        for model, figures in entry["models"].items():
            row = out.setdefault(model, {})
            for name, value in figures.items():
                row[name] = row.get(name, 0) + value
    return out


def test_usage_is_counted_under_the_resolved_model(rig):
    """An alias counts under its model, an adapter under its base, an unknown name under
    `other` (never the client's text as a label); the tokens are each answer's own."""
    gw, _, _ = rig
    before = usage_by_model(gw)
    told = {"alpha": 0, "beta": 0}
    for model, base in (("alpha", "alpha"), ("fast", "beta"), ("beta", "beta"),
                        ("alpha:my-adapter", "alpha"), ("fast", "beta")):
        r = httpx.post(gw + "/v1/chat/completions", json=chat(model), timeout=30)
        assert r.status_code == 200, r.text
        told[base] += r.json()["usage"]["completion_tokens"]
    assert httpx.post(gw + "/v1/chat/completions", json=chat("gpt-5"),
                      timeout=30).status_code == 404

    def delta(model: str, name: str) -> int:
        return usage_by_model(gw).get(model, {}).get(name, 0) - before.get(model, {}).get(name, 0)

    deadline = time.monotonic() + 10  # a prefill's figures may land after the answer
    while time.monotonic() < deadline and (delta("alpha", "prompt_tokens") <= 0
                                           or delta("beta", "prompt_tokens") <= 0):
        time.sleep(0.1)
    assert (delta("alpha", "requests"), delta("beta", "requests")) == (2, 3)
    assert (delta("alpha", "completion_tokens"), delta("beta", "completion_tokens")) == (
        told["alpha"], told["beta"])
    assert delta("alpha", "prompt_tokens") > 0 and delta("beta", "prompt_tokens") > 0
    assert (delta("other", "requests"), delta("other", "errors_4xx")) == (1, 1)
    assert not {"fast", "gpt-5", "alpha:my-adapter"} & set(usage_by_model(gw))
    metrics = httpx.get(gw + "/metrics", timeout=30).text
    assert 'model="beta"' in metrics and 'model="fast"' not in metrics


def test_readiness_and_health_generate_cover_every_model(rig):
    gw, _, _ = rig
    ready = httpx.get(gw + "/readiness", timeout=30).json()
    assert ready["ready"] and ready["models"] == {"alpha": True, "beta": True}
    assert httpx.get(gw + "/health_generate", timeout=30).status_code == 200
    r = httpx.post(gw + "/v1/tokenize", json={"model": "fast", "prompt": "a b c"}, timeout=30)
    assert r.status_code == 200 and r.json()["count"] > 0


def test_default_model_takes_requests_without_model(rig):
    _, sims, log_dir = rig
    with gateway(log_dir, sims, "--default-model", "fast", "--model-aliases", ALIASES,
                 name="gw-default") as gw:
        before = received(sims["beta"]["decode"][0])
        for body in (chat(None), chat("default")):
            r = httpx.post(gw + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
        assert received(sims["beta"]["decode"][0]) - before == 2
        r = httpx.post(gw + "/v1/chat/completions", json=chat("alpha"), timeout=30)
        assert r.status_code == 200


def test_a_server_joins_its_model_once_its_probe_answers(rig):
    """gamma's servers are down at the gateway's start: they serve no model (no request can
    reach them), the 404 for gamma says servers are unprobed; once they answer, gamma is a
    model of its own, listed and routed, with its own policies started at run time."""
    _, sims, log_dir = rig
    gamma_p, gamma_boot, gamma_d = free_port(), free_port(), free_port()
    pending = {"gamma": {"prefill": [(f"http://{HOST}:{gamma_p}", gamma_boot)],
                         "decode": [f"http://{HOST}:{gamma_d}"]}}
    with gateway(log_dir, {**sims, **pending}, name="gw-late") as gw:
        r = httpx.post(gw + "/v1/chat/completions", json=chat("gamma"), timeout=30)
        assert r.status_code == 404
        assert "2 servers have not reported their model yet" in r.json()["error"]["message"]
        models_of = {s["url"]: s["model"] for s in httpx.get(
            gw + "/admin/servers", timeout=30).json()["servers"]}
        assert models_of[f"http://{HOST}:{gamma_d}"] is None
        assert models_of[sims["beta"]["decode"][0]] == "beta"
        with contextlib.ExitStack() as stack:
            for role, port, boot in (("prefill", gamma_p, gamma_boot), ("decode", gamma_d, None)):
                url = f"http://{HOST}:{port}"
                stack.enter_context(running(f"gamma-{role}", sim(
                    role, port, boot, "--served-model-name", "gamma", "--fast"), log_dir,
                    url + "/health"))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                ids = [c["id"] for c in httpx.get(gw + "/v1/models", timeout=30).json()["data"]]
                if "gamma" in ids and httpx.get(gw + "/readiness").json()["models"].get("gamma"):
                    break
                time.sleep(0.2)
            assert ids == ["alpha", "beta", "gamma"]
            r = httpx.post(gw + "/v1/chat/completions", json=chat("gamma"), timeout=30)
            assert r.status_code == 200, r.text
            assert received(f"http://{HOST}:{gamma_d}") == 1
            policies = httpx.get(gw + "/admin/policies", timeout=30).json()["models"]
            assert set(policies["gamma"]["prefill"]["stats"]["tree_size_by_worker"]) == {
                f"http://{HOST}:{gamma_p}"}


def test_a_single_model_gateway_is_lenient_about_the_model_name(rig):
    """One model behind the gateway: as SGLang, any `model` (or none) is served by it, the
    body passes as sent, and usage counts under the model's own name."""
    _, sims, log_dir = rig
    with gateway(log_dir, {"beta": sims["beta"]}, name="gw-single") as gw:
        for body in (chat(None), chat("beta"), chat("gpt-4o"), chat("default")):
            r = httpx.post(gw + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
        assert r.json()["model"] == "default"  # SGLang echoes what was asked
        ids = [c["id"] for c in httpx.get(gw + "/v1/models", timeout=30).json()["data"]]
        assert ids == ["beta"]
        assert "models" not in httpx.get(gw + "/readiness", timeout=30).json()
        assert usage_by_model(gw)["beta"]["requests"] == 4


def test_launch_with_a_two_model_topology(tmp_path):
    port = free_port()
    gw = f"http://{HOST}:{port}"
    argv = python("-m", "gateway", "--launch", "--port", str(port), "--launch-config",
                  str(ROOT / "deploy/sim/topology-two-models.yaml"),
                  "--model-aliases", json.dumps({"quick": "small"}))
    with running("gw-launch-models", argv, tmp_path, gw + "/readiness", timeout=60,
                 env={"LAUNCHER_LOG_DIR": str(tmp_path / "servers")}):
        for model in ("large", "small", "quick", "small"):
            r = httpx.post(gw + "/v1/chat/completions", json=chat(model), timeout=30)
            assert r.status_code == 200, r.text
        servers = httpx.get(gw + "/admin/servers", timeout=30).json()["servers"]
        served = {}
        for server in servers:
            served.setdefault(server["model"], {}).setdefault(server["role"], 0)
            served[server["model"]][server["role"]] += server["total_requests"]
        assert served == {"large": {"prefill": 1, "decode": 1},
                          "small": {"prefill": 3, "decode": 3}}
        ids = [c["id"] for c in httpx.get(gw + "/v1/models", timeout=30).json()["data"]]
        assert ids == ["large", "small", "quick"]
