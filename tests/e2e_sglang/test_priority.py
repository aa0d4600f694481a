"""Priorities forwarded to real SGLang 0.5.23 (docs/TENANCY.md, "Priority forwarded to SGLang").

`--forward-priority auto` (the default) decides per server from two fields of its
`/server_info` (`enable_priority_scheduling`, `schedule_low_priority_values_first`: ServerArgs fields,
srt/arg_groups/fields/schedule.py); these tests show that real SGLang reports them, that the gateway read them as
SGLang reports them, and that the `priority` field the gateway adds to both PD legs with
`--forward-priority on` is one SGLang's PD prefill and decode accept (`GenerateReqInput.priority`;
with priority scheduling off and `--abort-on-priority-when-disabled` unset, the scheduler
ignores it: `Scheduler._set_or_validate_priority`), for native and OpenAI requests, streamed
and not, whatever class the header asks for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e_sglang.conftest import SglangCluster
from tests.procs import HOST, free_port, python, running

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def forwarding(sglang_cluster: SglangCluster, tmp_path_factory) -> Iterator[str]:
    """A second gateway in front of the cluster's servers that sends `priority` on every leg."""
    port = free_port()
    argv = python("-m", "gateway", "--port", str(port), "--forward-priority", "on",
                  "--health-interval", "3")
    for server in sglang_cluster.prefill:
        argv += ["--prefill", server.url, str(server.bootstrap_port)]
    for server in sglang_cluster.decode:
        argv += ["--decode", server.url]
    url = f"http://{HOST}:{port}"
    with running("gateway-forward-priority", argv, tmp_path_factory.mktemp("logs"),
                 url + "/readiness"):
        yield url


def test_sglang_reports_the_fields_auto_reads(sglang_cluster: SglangCluster) -> None:
    for server in (*sglang_cluster.prefill, *sglang_cluster.decode):
        info = httpx.get(server.url + "/server_info", timeout=30).json()
        assert info["enable_priority_scheduling"] is False  # the rig starts it off
        assert info["schedule_low_priority_values_first"] is False
        assert info["abort_on_priority_when_disabled"] is False


@pytest.mark.parametrize("klass", ["interactive", "batch"])
def test_native_requests_with_a_forwarded_priority_are_served(forwarding, klass) -> None:
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4,
                                                                    "temperature": 0}}
    r = httpx.post(forwarding + "/generate", json=body, timeout=120,
                   headers={"x-priority": klass})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert isinstance(answer["text"], str)
    assert 1 <= answer["meta_info"]["completion_tokens"] <= 4


def test_a_streamed_chat_with_a_forwarded_priority_is_served(forwarding,
                                                             sglang_cluster) -> None:
    body = {"model": sglang_cluster.model_name, "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hello"}]}
    with httpx.stream("POST", forwarding + "/v1/chat/completions", json=body, timeout=120,
                      headers={"x-priority": "interactive"}) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_bytes())
    events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all("error" not in c for c in chunks)
    assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks)
