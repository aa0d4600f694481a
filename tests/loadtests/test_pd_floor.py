"""The measuring stick of the overhead benchmark (`python-floor`) is a correct PD proxy: the PD
stub answers a room only when both legs arrived with it and the decode leg names the prefill's
bootstrap host and port, so a wrong leg would fail (500 after the stub's pair timeout). The stub is the benchmarks' own (`loadtests.cluster`)."""

from __future__ import annotations

import httpx

from loadtests.cluster import cluster
from tests.procs import HOST, free_port, python, running


def test_both_legs_meet_and_the_answer_comes_back(tmp_path):
    with cluster("stub", 2, None, tmp_path) as servers:
        port = free_port()
        floor = python("-m", "loadtests.pd_floor", "--host", HOST, "--port", str(port),
                       "--prefill", servers.prefill_url, str(servers.bootstrap_port))
        for decode in servers.decode_urls:
            floor += ["--decode", decode]
        with running("floor", floor, tmp_path, f"http://{HOST}:{port}/health"), \
                httpx.Client(base_url=f"http://{HOST}:{port}", timeout=10) as client:
            for _ in range(4):  # both decodes in turn
                r = client.post("/generate", json={"text": "hi",
                                                   "sampling_params": {"max_new_tokens": 3}})
                assert r.status_code == 200, r.text
                assert r.json()["meta_info"]["completion_tokens"] == 3
