"""The README's examples, run as written against the gateway in front of simulated servers:
its curl commands with the real curl, its Python snippets (the openai SDK, LangChain) with
this interpreter. Only the address changes (`localhost:8000` is the test gateway's)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.procs import ROOT


def examples(language: str) -> list[str]:
    """The code blocks of `language` in the README's "Examples" section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### Examples", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, re.S)


def commands(block: str) -> list[str]:
    """The block's shell commands, continuation lines joined."""
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def test_the_readme_has_curl_and_python_examples():
    assert [c for b in examples("bash") for c in commands(b) if c.startswith("curl ")]
    assert len(examples("python")) >= 2


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_curl_examples_answer(fresh):
    address = fresh.gateway.removeprefix("http://")
    ran = 0
    for block in examples("bash"):
        for command in commands(block):
            if not command.startswith("curl "):
                continue
            done = subprocess.run(["bash", "-c", command.replace("localhost:8000", address)
                                   + " -w '\\n%{http_code}'"], capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode == 0, (command, done.stderr)
            body, status = done.stdout.rsplit("\n", 1)
            assert status == "200", (command, body)
            if '"stream": true' in command:
                events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]" and len(events) > 2, body
                assert all("error" not in json.loads(e) for e in events[:-1]), body
            else:
                answer = json.loads(body)
                assert answer["choices"][0]["message"]["content"], answer
            ran += 1
    assert ran >= 2


def test_the_python_examples_run(fresh):
    for block in examples("python"):
        code = block.replace("http://localhost:8000", fresh.gateway)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert done.returncode == 0, (code, done.stderr[-2000:])
        assert done.stdout.strip(), code  # each example prints the model's answer
