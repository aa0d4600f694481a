"""The attacks against what ships: the defaults with no flags at all, and the Kubernetes
manifests (deploy/k8s/base) as a pod would run them.

* Defaults (no keys, no flags), in process with the real simulators behind the real app:
  strangers are played by ASGI client addresses (all real sockets of this suite are
  loopback). The admin API refuses them; anonymous callers own their requests per address,
  so a stranger cannot abort another's request even knowing its ids.
* Manifests: the gateway is started with the StatefulSet's args and env and the ConfigMap's
  gateway.yaml, the key files where the Secret's volume puts them (under a temporary root).
  What a test machine cannot have is replaced and nothing else: loopback instead of 0.0.0.0,
  the simulators' URLs instead of pod discovery (no API server here), a free port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import orjson
import pytest
import yaml

from gateway.app import build_app
from gateway.config.settings import load_config
from tests.procs import ROOT
from tests.security.conftest import UNICODE_KEY, bearer
from tests.security.foreign import Foreign
from tests.security.honest import Honest, Stream
from tests.security.rig import Gateway, start_gateway
from tests.security.test_abort_hijack import check_hijack_fails, check_own_abort
from tests.security.test_admin_ssrf import refused_for_strangers

BASE = ROOT / "deploy" / "k8s" / "base"
A_ADDRESS, B_ADDRESS = ("203.0.113.9", 41000), ("198.51.100.7", 42000)
DISCOVERY = ("prefill_selector", "decode_selector", "namespace", "k8s_worker_port",
             "k8s_model_label", "k8s_drain_timeout")


def test_on_the_defaults_strangers_can_neither_add_servers_nor_abort_others(sims):
    body = {"text": "defaults", "stream": True, "sampling_params": {"max_new_tokens": 150}}

    async def go(target: Foreign):
        app = build_app(load_config(sims.server_args(), environ={}))
        async with app.router.lifespan_context(app):
            def client(address):
                return httpx.AsyncClient(base_url="http://gateway", timeout=30,
                                         transport=httpx.ASGITransport(app, client=address))

            async with client(A_ADDRESS) as a, client(B_ADDRESS) as b:
                victim = asyncio.create_task(a.post("/generate", json=body,
                                                    headers={"x-request-id": "victim-1"}))
                while not app.state.gateway.inflight.find("victim-1"):
                    await asyncio.sleep(0.01)
                tracked = app.state.gateway.inflight.find("victim-1")
                while not tracked.attempts:
                    await asyncio.sleep(0.01)
                upstream = next(iter(tracked.attempts)).rid_list[0]
                for rid in ("victim-1", upstream, upstream[:4], "victim"):
                    r = await b.post("/abort_request", json={"rid": rid})
                    assert r.status_code == 404, (rid, r.text)  # known ids, not B's requests
                assert (await b.post("/abort_request", json={"abort_all": True})).status_code \
                    == 403
                for method, path in (("POST", "/admin/servers"), ("DELETE", "/admin/servers"),
                                     ("POST", "/flush_cache")):
                    r = await b.request(method, path, json={"url": target.url, "role": "decode"})
                    assert r.status_code == 403, (path, r.text)
                answer = await victim
            assert target.hits == []
        events = [orjson.loads(line[5:]) for line in answer.text.splitlines()
                  if line.startswith("data:") and "[DONE]" not in line]
        assert answer.status_code == 200
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"

    with Foreign() as target:
        asyncio.run(asyncio.wait_for(go(target), 60))


def pod_spec() -> tuple[list[str], dict, dict]:
    """(args, env with plain values, gateway.yaml) of the gateway container in the base."""
    sts = yaml.safe_load((BASE / "statefulset.yaml").read_text())
    container = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    env["POD_NAME"] = f"{sts['metadata']['name']}-0"  # the downward API's value
    config = yaml.safe_load((BASE / "gateway.yaml").read_text())
    return container["args"], env, config


@pytest.fixture(scope="module")
def shipped(logs, sims, key_file) -> Iterator[Gateway]:
    args, env, config = pod_spec()
    assert config["host"] == "0.0.0.0" and "api_key_file" in config
    root = logs / "pod"
    for setting, key in (("api_key_file", key_file.read_text()),
                         ("admin_api_key_file", "sk-shipped-admin-key\n")):
        path = root / config[setting].lstrip("/")  # where the Secret's volume puts it
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(key)
        config[setting] = str(path)
    for name in DISCOVERY:
        config.pop(name, None)
    config.update(host="127.0.0.1", prefill=[sims.prefill.tap.url],
                  decode=[sims.decode.tap.url])  # the port: a free one, as a flag
    config_file = root / "gateway.yaml"
    config_file.write_text(yaml.safe_dump(config))
    args = [str(config_file) if a.endswith("gateway.yaml") else a for a in args]
    gateway = start_gateway(logs, "shipped", None, args, env=env, headers=bearer(UNICODE_KEY),
                            admin_headers=bearer("sk-shipped-admin-key"))
    yield gateway
    gateway.stop()


def test_the_manifests_refuse_admin_ssrf(shipped, sims):
    with Foreign() as target, Honest(shipped):
        refused_for_strangers(shipped, target)
        r = shipped.post("/admin/servers", shipped.admin_headers,
                         json={"url": target.url, "role": "prefill"})
        assert r.status_code == 400, r.text  # an admin too: it is not an SGLang server
    assert set(shipped.servers()) == {s.tap.url for s in sims.both}


def test_the_manifests_refuse_abort_hijack(shipped, sims):
    with Honest(shipped):
        check_hijack_fails(shipped, sims)
        check_own_abort(shipped, sims, "request_id")


def test_the_manifests_serve_with_the_secret_keys_only(shipped):
    assert "inference: 3 keys; admin: 1 keys" in shipped.proc.log()
    assert shipped.post("/generate", json={"text": "x"}).status_code == 401
    stream = Stream(shipped, shipped.headers, tokens=5)
    stream.start()
    assert stream.finish().completed
