"""The README's first command: the gateway launches a simulated cluster and serves it."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx

from tests.procs import ROOT, free_port, python, running


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_test_command_is_what_ci_runs():
    run_cmd, test_cmd = readme_commands()[:2]
    assert "python -m gateway --launch" in run_cmd
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd.split("&&")[-1].strip() in ci.splitlines()


def children_of(pid: int) -> set[int]:
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines()
                          if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            found.add(int(status.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_launch_serves_and_sigterm_leaves_no_servers(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = python("-m", "gateway", "--launch", "--port", str(port))
    with running("gw-launch", argv, tmp_path, url + "/readiness", timeout=60) as proc:
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        servers = httpx.get(url + "/admin/servers", timeout=5).json()["servers"]
        assert sorted(s["role"] for s in servers) == ["decode", "decode", "prefill"]
        kids = children_of(proc.popen.pid)
        assert len(kids) >= 3
        os.kill(proc.popen.pid, signal.SIGTERM)
        assert proc.popen.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
        deadline = time.monotonic() + 10
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [k for k in kids if alive(k)], proc.log()
