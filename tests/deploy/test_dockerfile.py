"""The Dockerfile and .dockerignore, checked without a Docker engine (none runs here).

Static checks of the instructions, the build context .dockerignore leaves, and one real
step: the project wheel built from that context, as the builder stage builds it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass

from gateway.config.settings import GatewayConfig
from tests.deploy.manifests import container, find, render
from tests.procs import ROOT

SKIP_DIRS = {".git", ".mypy_cache", ".pytest_cache", ".ruff_cache", "__pycache__"}


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]]  # (INSTRUCTION, arguments)


def parse_dockerfile(text: str) -> list[Stage]:
    """Instructions grouped by stage; comments dropped, continuation lines joined."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.strip().partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.I)
            stages.append(Stage(match.group(2) or str(len(stages)), match.group(1), []))
        elif stages:
            stages[-1].instructions.append((keyword, rest.strip()))
    return stages


def dockerfile() -> list[Stage]:
    return parse_dockerfile((ROOT / "Dockerfile").read_text())


def instructions(stage: Stage, keyword: str) -> list[str]:
    return [rest for key, rest in stage.instructions if key == keyword]


def copy_sources(rest: str) -> tuple[list[str], str | None]:
    """COPY arguments -> (sources, --from stage or None)."""
    words = rest.split()
    source_stage = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
    paths = [w for w in words if not w.startswith("--")]
    return paths[:-1], source_stage


def _glob(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i:end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        rules.append((negate, _glob(pattern)))
    return rules


def build_context() -> set[str]:
    """Files Docker would send: a path is out when the last rule matching it or one of its
    parent directories excludes it (Docker's rule order: the last match wins)."""
    rules = dockerignore_rules()
    kept = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), ROOT).replace(os.sep, "/")
            parts = path.split("/")
            prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
            excluded = False
            for negate, pattern in rules:
                if any(pattern.fullmatch(p) for p in prefixes):
                    excluded = not negate
            if not excluded:
                kept.add(path)
    return kept


def test_multi_stage_build():
    stages = dockerfile()
    assert [s.name for s in stages] == ["builder", "runtime"]
    assert all("slim" in s.base for s in stages)
    assert any("pip wheel" in run for run in instructions(stages[0], "RUN"))


def test_runtime_runs_as_a_non_root_user():
    runtime = dockerfile()[-1]
    user = instructions(runtime, "USER")[-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) >= 1000, user  # numeric, so runAsNonRoot can check it
    sts = find(render("base"), "StatefulSet", "pd-gateway")
    assert sts["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid)


def test_runtime_holds_no_tests_or_backends():
    runtime = dockerfile()[-1]
    for keyword in ("COPY", "ADD"):
        for rest in instructions(runtime, keyword):
            _, source_stage = copy_sources(rest)
            assert source_stage == "builder", f"runtime {keyword} from the context: {rest}"
    text = " ".join(rest for _, rest in runtime.instructions)
    for banned in ("tests", "backends", "loadtests"):
        assert not re.search(rf"\b{banned}\b", text), banned
    runs = instructions(runtime, "RUN")
    assert any("--no-index" in r and "from=builder" in r for r in runs)


def test_builder_copies_only_the_package():
    builder = dockerfile()[0]
    sources = [s for rest in instructions(builder, "COPY") for s in copy_sources(rest)[0]]
    assert sorted(s.rstrip("/") for s in sources) == ["gateway", "pyproject.toml"]


def test_entrypoint_port_and_healthcheck():
    runtime = dockerfile()[-1]
    assert json.loads(instructions(runtime, "ENTRYPOINT")[-1]) == ["python", "-m", "gateway"]
    assert (ROOT / "gateway" / "__main__.py").is_file()
    exposed = {int(p.split("/")[0]) for rest in instructions(runtime, "EXPOSE")
               for p in rest.split()}
    cmd = json.loads(instructions(runtime, "CMD")[-1])
    port = int(cmd[cmd.index("--port") + 1])
    assert port in exposed
    sts = find(render("base"), "StatefulSet", "pd-gateway")
    assert container(sts)["ports"][0]["containerPort"] in exposed
    assert GatewayConfig().port in exposed
    assert f":{port}/health" in instructions(runtime, "HEALTHCHECK")[-1]


def test_build_context_is_the_package_only():
    context = build_context()
    package = {p for p in (path.relative_to(ROOT).as_posix()
                           for path in (ROOT / "gateway").rglob("*")
                           if path.is_file() and "__pycache__" not in path.parts)}
    assert "pyproject.toml" in context
    assert package <= context, sorted(package - context)[:5]
    assert "gateway/static/dashboard.html" in context
    outside = {p for p in context if p != "pyproject.toml" and not p.startswith("gateway/")}
    assert outside == set(), sorted(outside)[:10]


def test_wheel_from_the_context_holds_only_the_gateway(tmp_path):
    """What the builder stage does (`pip wheel .` on the context), minus dependencies.
    pip fetches the build backend (setuptools) from the package index, as in the image."""
    source = tmp_path / "context"
    for path in build_context():
        target = source / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / path, target)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
         "--disable-pip-version-check", "--wheel-dir", str(tmp_path / "wheels"), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    wheel = next((tmp_path / "wheels").glob("pd_gateway-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"gateway"}
    assert "gateway/__main__.py" in names and "gateway/static/dashboard.html" in names
    assert "gateway/discovery/kubernetes.py" in names
