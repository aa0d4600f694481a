"""POST /pd_role_switch on the simulator: SGLang's refusals, prepare_only, the flip itself."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from backends.launcher.ports import free_port
from tests.sim.conftest import PD_FLAGS
from tests.sim.simproc import HOST, Sim

pytestmark = pytest.mark.timeout(60)

GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
FLAG = "--enable-pd-role-switch"


def switch(sim: Sim, **body) -> httpx.Response:
    return sim.post("/pd_role_switch", json=body)


def live_role(sim: Sim) -> str:
    """The role now: /model_info's and the schedulers' internal state (/server_info's own
    top-level field stays the launch configuration, as SGLang's)."""
    info = sim.get("/server_info").json()
    assert sim.get("/model_info").json()["disaggregation_mode"] == \
        info["internal_states"][0]["disaggregation_mode"]
    return info["internal_states"][0]["disaggregation_mode"]


def own_bootstrap() -> tuple[str, str]:
    """A decode started with the flag runs a bootstrap server too: give it its own port."""
    return "--bootstrap-port", str(free_port())


def pd_request(prefill: Sim, prefill_bootstrap: int, decode: Sim, room: int) -> list[int]:
    fields = {"bootstrap_host": HOST, "bootstrap_port": prefill_bootstrap, "bootstrap_room": room}

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=10) as client:
            answers = await asyncio.gather(
                client.post(prefill.url + "/generate", json={**GENERATE, **fields}),
                client.post(decode.url + "/generate", json={**GENERATE, **fields}))
            return [a.status_code for a in answers]
    return asyncio.run(run())


def test_without_the_flag_it_refuses_safely(sim_factory):
    decode = sim_factory("decode", *PD_FLAGS)
    r = switch(decode, new_role="prefill")
    assert r.status_code == 400
    assert r.json() == {"success": False, "message": "--enable-pd-role-switch is not set on "
                        "this server", "old_role": "decode", "new_role": "prefill",
                        "safe_to_restore": True}


def test_decode_to_prefill_and_back_serves_each_role(sim_factory, room):
    port = free_port()
    flipper = sim_factory("decode", *PD_FLAGS, FLAG, "--bootstrap-port", str(port))
    other_decode = sim_factory("decode", *PD_FLAGS)
    prefill = sim_factory("prefill", *PD_FLAGS)
    ready = switch(flipper, new_role="prefill", prepare_only=True)
    assert ready.status_code == 200 and ready.json()["message"] == "ready"
    assert live_role(flipper) == "decode"
    assert switch(flipper, new_role="prefill").json()["message"] == "ok"
    info = flipper.get("/server_info").json()
    assert live_role(flipper) == "prefill"
    assert (info["disaggregation_mode"], info["disaggregation_bootstrap_port"]) == ("decode", port)
    # the bootstrap server was up from launch: the new prefill pairs with a decode at once
    assert pd_request(flipper, port, other_decode, room()) == [200, 200]
    # started as a decode, its graphs are captured: no graph memory needed to go back
    assert switch(flipper, new_role="decode").json()["message"] == "ok"
    assert pd_request(prefill, prefill.bootstrap_port, flipper, room()) == [200, 200]
    assert switch(flipper, new_role="decode").json()["message"] == "already in target role"
    assert flipper.stats()["role_switches"] == 2


def test_a_prefill_becoming_decode_needs_the_graph_memory(sim_factory):
    prefill = sim_factory("prefill", *PD_FLAGS, FLAG)
    r = switch(prefill, new_role="decode")
    assert r.status_code == 400 and r.json()["safe_to_restore"] is True
    assert r.json()["message"] == ("decode_cuda_graph_memory_gb is required before capturing "
                                   "decode graphs")
    prefill.post("/sim/faults", json={"gpu_free_gb": 0.25})
    r = switch(prefill, new_role="decode", decode_cuda_graph_memory_gb=0.5, prepare_only=True)
    assert r.status_code == 400 and r.json()["safe_to_restore"] is True
    assert r.json()["message"] == ("insufficient decode CUDA graph headroom: required=0.500 GB, "
                                   "available=0.250 GB")
    prefill.post("/sim/faults", json={"gpu_free_gb": 80})
    r = switch(prefill, new_role="decode", decode_cuda_graph_memory_gb=0.5)
    assert r.status_code == 200, r.text
    assert live_role(prefill) == "decode"
    assert prefill.get("/server_info").json()["internal_states"][0]["decode_cuda_graph_bs"]


def test_a_busy_instance_is_not_switched(sim_factory, room):
    prefill = sim_factory("prefill", *PD_FLAGS, FLAG)

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=10) as client:
            waiting = asyncio.create_task(client.post(
                prefill.url + "/generate", json={**GENERATE, **prefill.pd_fields(room())}))
            await asyncio.sleep(0.3)  # it holds its room, waiting for a decode
            refused = await client.post(prefill.url + "/pd_role_switch",
                                        json={"new_role": "decode", "prepare_only": True,
                                              "decode_cuda_graph_memory_gb": 0})
            return refused, await waiting
    refused, _ = asyncio.run(run())
    assert refused.status_code == 400
    assert refused.json()["message"] == ("instance is not idle; drain all requests before "
                                         "switching")
    assert refused.json()["safe_to_restore"] is True
    assert live_role(prefill) == "prefill"


def test_a_switch_failing_midway_leaves_it_unhealthy(sim_factory):
    prefill = sim_factory("prefill", *PD_FLAGS, FLAG)
    prefill.post("/sim/faults", json={"role_switch_fail": True})
    r = switch(prefill, new_role="decode", decode_cuda_graph_memory_gb=0)
    assert r.status_code == 400 and r.json()["safe_to_restore"] is False
    assert r.json()["message"].startswith("role switch failed; instance unhealthy, restart "
                                          "required: ")
    prefill.post("/sim/faults", json={"role_switch_fail": False})
    again = switch(prefill, new_role="decode", decode_cuda_graph_memory_gb=0)
    assert again.json() == {"success": False, "message": "instance is unhealthy after a failed "
                            "role switch; restart required", "old_role": "prefill",
                            "new_role": "decode", "safe_to_restore": False}


@pytest.mark.parametrize(("flags", "body", "message"), [
    pytest.param(("--transfer-backend", "nixl"), {"new_role": "decode"},
                 "transfer backend 'nixl' does not support runtime role switch", id="backend"),
    pytest.param((), {"new_role": ""}, "invalid new_role=''", id="no-role"),
])
def test_other_reasons(sim_factory, flags, body, message):
    prefill = sim_factory("prefill", *PD_FLAGS, FLAG, *flags)
    r = switch(prefill, **body)
    assert r.status_code == 400 and r.json()["message"] == message
    assert r.json()["safe_to_restore"] is True
