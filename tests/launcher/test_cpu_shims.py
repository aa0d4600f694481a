"""The CPU-rig shims, checked without SGLang: a fake `mooncake/conn.py` stands in for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SHIMS = Path(__file__).resolve().parents[2] / "backends/sglang_cpu/shims"
FAKE_CONN = "class MooncakeKVSender:\n    supports_host_tensor_indices = True\n"
PROBE = (
    "import sys\n"
    "print('sglang' in sys.modules)\n"
    "from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender\n"
    "print(MooncakeKVSender.supports_host_tensor_indices)\n"
)


@pytest.fixture
def fake_sglang(tmp_path: Path) -> Path:
    package = tmp_path / "sglang/srt/disaggregation/mooncake"
    package.mkdir(parents=True)
    for folder in [package, *package.parents][:4]:
        (folder / "__init__.py").touch()
    (package / "conn.py").write_text(FAKE_CONN)
    return tmp_path


def run_python(code: str, pythonpath: list[Path], cpu_engine: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    if cpu_engine is not None:
        env["SGLANG_USE_CPU_ENGINE"] = cpu_engine
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return result.stdout.split()


@pytest.mark.parametrize(
    ("cpu_engine", "expected"),
    [
        pytest.param("1", ["False", "False"], id="patched-with-cpu-engine"),
        pytest.param(None, ["False", "True"], id="inert-without-cpu-engine"),
        pytest.param("0", ["False", "True"], id="inert-with-cpu-engine-0"),
    ],
)
def test_sitecustomize_patches_lazily(
    fake_sglang: Path, cpu_engine: str | None, expected: list[str]
) -> None:
    # first value: SGLang was not imported eagerly at interpreter start
    assert run_python(PROBE, [SHIMS, fake_sglang], cpu_engine) == expected


def test_sgl_kernel_stand_in_imports_anything_and_raises_when_called() -> None:
    code = (
        "import sgl_kernel.kvcacheio as kv\n"
        "from sgl_kernel import silu_and_mul\n"
        "from sgl_kernel.scalar_type import scalar_types\n"
        "print(scalar_types.uint4b8 is not None)\n"
        "try:\n    kv.transfer_kv_direct(1)\n"
        "except sgl_kernel.SglKernelUnavailable as e:\n    print(str(e).split()[0])\n"
    )
    code = "import sgl_kernel\n" + code
    assert run_python(code, [SHIMS], "1") == ["True", "sgl_kernel.kvcacheio.transfer_kv_direct"]
