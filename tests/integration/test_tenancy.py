"""Priorities, fairness, deadlines and departures in admission, against real processes.

One gateway (--max-concurrency 2 --max-queue 3) in front of a simulated prefill that
schedules by priority (`--enable-priority-scheduling`) and a simulated decode that aborts any
request carrying a priority (`--abort-on-priority-when-disabled`, 503 as SGLang does), so
`--forward-priority auto` must send the class to the prefill only. Two tenants from the key
file: `batchers` (weight 1, at most batch) and `team` (weight 3, interactive).

Every ordering below is forced by the slots, not by timing: a queued request can only start
when a slot is freed, so "the interactive request finished before the queued batch ones" can
only hold if the slot went to it first. Waits poll the gateway's gauges with a deadline.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time

import httpx
import pytest

from tests.integration.conftest import sim
from tests.procs import HOST, free_port, python, running
from tests.rigs.faults import Metrics, wait_until

BATCH_KEY, TEAM_KEY = "kb-0123456789", "kt-0123456789"
TENANTS = '{"batchers": {"priority": "batch", "max_priority": "batch", "weight": 1}, ' \
          '"team": {"priority": "interactive", "weight": 3}}'
TOKEN_DELAY = 0.05  # seconds per decoded token


def auth(key: str, **headers: str) -> dict:
    return {"authorization": f"Bearer {key}", **headers}


def body(tokens: int, tag: str) -> dict:
    return {"text": f"{tag} tenancy", "sampling_params": {"max_new_tokens": tokens},
            "rid": tag}


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("tenancy")
    keys = log_dir / "keys"
    keys.write_text(f"{BATCH_KEY} batchers\n{TEAM_KEY} team\n")
    with contextlib.ExitStack() as stack:
        port, boot, dport = free_port(), free_port(), free_port()
        prefill, decode = f"http://{HOST}:{port}", f"http://{HOST}:{dport}"
        delay = ("--token-delay", str(TOKEN_DELAY))
        stack.enter_context(running("prefill", sim("prefill", port, boot, *delay,
                                                   "--enable-priority-scheduling"),
                                    log_dir, prefill + "/health"))
        stack.enter_context(running("decode", sim("decode", dport, None, *delay,
                                                  "--abort-on-priority-when-disabled"),
                                    log_dir, decode + "/health"))
        gw_port = free_port()
        gateway = f"http://{HOST}:{gw_port}"
        base = python("-m", "gateway", "--host", HOST, "--prefill", prefill, str(boot),
                      "--decode", decode, "--api-key-file", str(keys), "--tenants", TENANTS)
        stack.enter_context(running("gateway", base + [
            "--port", str(gw_port), "--max-concurrency", "2", "--max-queue", "3",
            "--queue-timeout", "10"], log_dir, gateway + "/readiness"))
        yield {"gateway": gateway, "prefill": prefill, "decode": decode, "base": base,
               "log_dir": log_dir}


class Client:
    """Requests in threads, each on its own connection; answers and finish times kept."""

    def __init__(self, gateway: str) -> None:
        self.gateway = gateway
        self.pool = concurrent.futures.ThreadPoolExecutor(16)
        self.done: dict[str, tuple[httpx.Response | Exception, float]] = {}
        self.lock = threading.Lock()

    def send(self, tag: str, key: str, tokens: int, timeout: float = 30.0,
             **headers: str) -> concurrent.futures.Future:
        def one():
            try:
                with httpx.Client(timeout=timeout) as client:
                    answer = client.post(self.gateway + "/generate", json=body(tokens, tag),
                                         headers=auth(key, **headers))
            except httpx.HTTPError as exc:
                answer = exc
            with self.lock:
                self.done[tag] = (answer, time.monotonic())
            return answer

        return self.pool.submit(one)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def metrics(gateway: str) -> Metrics:
    return Metrics.parse(httpx.get(gateway + "/metrics", timeout=5).text)


def waiting(gateway: str, **labels: str) -> float:
    return metrics(gateway).total("gateway_admission_waiting", **labels)


def active(gateway: str) -> float:
    return metrics(gateway).total("gateway_admission_active")


def received(url: str) -> int:
    return httpx.get(url + "/sim/stats", timeout=5).json()["received"]


def idle(rig) -> None:
    wait_until(lambda: active(rig["gateway"]) == 0 and waiting(rig["gateway"]) == 0, 30,
               "the gateway is idle again")


@pytest.mark.timeout(90)
def test_interactive_work_sheds_and_overtakes_a_batch_flood(rig):
    gw = rig["gateway"]
    idle(rig)
    client = Client(gw)
    try:
        long = client.send("long", BATCH_KEY, 80)  # holds a slot for ~4 s
        client.send("short", BATCH_KEY, 40)  # frees the other slot after ~2 s
        wait_until(lambda: active(gw) == 2, 10, "both slots taken")
        for n in (1, 2, 3):
            client.send(f"queued{n}", BATCH_KEY, 20, **{"x-priority": "interactive"})
            wait_until(lambda n=n: waiting(gw, tenant="batchers", priority="batch") == n,
                       10, f"{n} batch requests queued (their ask for more is capped)",
                       detail=lambda: (client.done, metrics(gw).samples))
        interactive = client.send("interactive", TEAM_KEY, 4)
        wait_until(lambda: "queued3" in client.done, 10, "the youngest batch request is shed")
        shed, _ = client.done["queued3"]
        assert shed.status_code == 429 and shed.headers["retry-after"] == "5", shed.text
        assert "shed" in shed.json()["error"]["message"]
        assert interactive.result(30).status_code == 200
        for tag in ("queued1", "queued2", "short"):  # (each waits for a slot it cannot take)
            while tag not in client.done:
                time.sleep(0.05)
            assert client.done[tag][0].status_code == 200, tag
        finished = {tag: at for tag, (_, at) in client.done.items()}
        assert finished["interactive"] < min(finished["queued1"], finished["queued2"])
        assert long.result(30).status_code == 200
    finally:
        client.close()
    m = metrics(gw)
    assert m.total("gateway_admission_requests_total", tenant="batchers", outcome="shed") == 1
    assert m.total("gateway_admission_requests_total", tenant="team", priority="interactive",
                   outcome="admitted") >= 1


def test_priority_goes_to_the_server_that_schedules_by_it_only(rig):
    before = {url: httpx.get(url + "/sim/stats", timeout=5).json()["priorities"]
              for url in (rig["prefill"], rig["decode"])}
    r = httpx.post(rig["gateway"] + "/generate", json=body(2, "fwd"), timeout=30,
                   headers=auth(TEAM_KEY, **{"x-priority": "interactive"}))
    assert r.status_code == 200, r.text  # the decode would have answered 503 to a priority
    after = {url: httpx.get(url + "/sim/stats", timeout=5).json()["priorities"]
             for url in (rig["prefill"], rig["decode"])}
    delta = {url: {k: v - before[url].get(k, 0) for k, v in after[url].items()
                   if v != before[url].get(k, 0)} for url in after}
    assert delta == {rig["prefill"]: {"20": 1}, rig["decode"]: {"None": 1}}


def test_forwarding_to_a_server_that_refuses_priorities_fails_as_sglang_does(rig):
    """Why `auto` is the default: `--forward-priority on` against a server started with
    --abort-on-priority-when-disabled gets SGLang's 503 on every decode leg (the gateway
    answers 502: an upstream failure, naming the server's status and message)."""
    port = free_port()
    gateway = f"http://{HOST}:{port}"
    argv = rig["base"] + ["--port", str(port), "--forward-priority", "on", "--max-attempts",
                          "1"]
    with running("gateway-forward-on", argv, rig["log_dir"], gateway + "/readiness"):
        r = httpx.post(gateway + "/generate", json=body(2, "fwd-on"), timeout=30,
                       headers=auth(TEAM_KEY))
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert "answered 503" in message and "Using priority is disabled" in message


@contextlib.contextmanager
def both_slots_held(rig):
    """A client whose two long batch requests hold both admission slots of the rig."""
    gw = rig["gateway"]
    idle(rig)
    client = Client(gw)
    try:
        client.send("hold1", BATCH_KEY, 60)
        client.send("hold2", BATCH_KEY, 60)
        wait_until(lambda: active(gw) == 2, 10, "both slots taken")
        yield client
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_a_client_that_leaves_while_queued_leaves_the_queue_at_once(rig):
    gw = rig["gateway"]
    with both_slots_held(rig) as client:
        sent = received(rig["decode"])
        left_before = metrics(gw).total("gateway_admission_requests_total", outcome="left")
        client.send("leaver", TEAM_KEY, 2, timeout=0.5)  # gives up after 0.5 s in the queue
        wait_until(lambda: waiting(gw) == 1, 10, "the request is queued")
        wait_until(lambda: "leaver" in client.done, 10, "the client gave up")
        took = wait_until(lambda: waiting(gw) == 0, 5, "the queue is empty again")
        assert took < 1.5, "left at once, not at the 10 s queue timeout"
        left = metrics(gw).total("gateway_admission_requests_total", outcome="left")
        assert left == left_before + 1
        assert isinstance(client.done["leaver"][0], httpx.TimeoutException)
        assert received(rig["decode"]) == sent, "no work was sent for the departed client"


@pytest.mark.timeout(60)
def test_the_clients_deadline_ends_its_wait_before_any_work(rig):
    gw = rig["gateway"]
    with both_slots_held(rig):
        sent = received(rig["decode"])
        started = time.monotonic()
        r = httpx.post(gw + "/generate", json=body(2, "hurried"), timeout=30,
                       headers=auth(TEAM_KEY, **{"x-request-timeout": "0.6"}))
        took = time.monotonic() - started
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error", r.text
        assert 0.55 <= took < 3.0, took  # its own 0.6 s, not the queue's 10 s
        assert received(rig["decode"]) == sent


@pytest.mark.parametrize("headers, fragment", [
    ({"x-priority": "urgent"}, "unknown priority class"),
    ({"x-request-timeout": "later"}, "x-request-timeout"),
], ids=["unknown-priority", "bad-deadline"])
def test_bad_tenancy_headers_are_a_400_in_the_openai_shape(rig, headers, fragment):
    r = httpx.post(rig["gateway"] + "/generate", json=body(2, "bad"), timeout=10,
                   headers=auth(TEAM_KEY, **headers))
    assert r.status_code == 400
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_header"
