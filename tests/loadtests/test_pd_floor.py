"""The measuring stick of the overhead benchmark (`python-floor`) is a correct PD proxy: the PD
stub answers a room only when both legs arrived with it and the decode leg names the prefill's
bootstrap host and port, so a wrong leg would fail (500 after the stub's pair timeout)."""

from __future__ import annotations

import httpx

from tests.procs import HOST, free_port, python, running


def test_both_legs_meet_and_the_answer_comes_back(tmp_path):
    prefill, bootstrap, decodes = free_port(), free_port(), [free_port(), free_port()]
    stub = python("-m", "loadtests.pdstub", "--host", HOST, "--prefill-port", str(prefill),
                  "--bootstrap-port", str(bootstrap), "--pair-timeout", "2")
    for port in decodes:
        stub += ["--decode-port", str(port)]
    port = free_port()
    floor = python("-m", "loadtests.pd_floor", "--host", HOST, "--port", str(port),
                   "--prefill", f"http://{HOST}:{prefill}", str(bootstrap))
    for decode in decodes:
        floor += ["--decode", f"http://{HOST}:{decode}"]
    with running("pdstub", stub, tmp_path, f"http://{HOST}:{prefill}/health"), \
            running("floor", floor, tmp_path, f"http://{HOST}:{port}/health"):
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=10) as client:
            for _ in range(4):  # both decodes in turn
                r = client.post("/generate", json={"text": "hi",
                                                   "sampling_params": {"max_new_tokens": 3}})
                assert r.status_code == 200, r.text
                assert r.json()["meta_info"]["completion_tokens"] == 3
