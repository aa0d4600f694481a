"""The peers' environment: sglang-router 0.3.2 (Rust router and mini_lb) in its own venv.

The wheel pins FastAPI/uvicorn/aiohttp versions of its own, so it lives outside the repository
and outside our environment (default `/opt/peers-venv`); it is created once and reused.
mini_lb imports aiohttp, fastapi, orjson and uvicorn (the wheel declares them). uvloop and
httptools are added so that mini_lb's uvicorn gets the same event loop and HTTP parser as our
gateway (SGLang's own environment ships uvloop): the comparison is between proxies, not between
asyncio and uvloop. Where no registry can be reached (the device machine), sglang-router is
installed beside our packages instead and `peer_python(..., python)` takes that interpreter.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

DEFAULT_VENV = Path("/opt/peers-venv")
PACKAGES = ["sglang-router==0.3.2", "aiohttp", "fastapi", "orjson", "uvicorn", "uvloop",
            "httptools"]
CHECK = ("import aiohttp, fastapi, orjson, uvicorn, uvloop, httptools, sglang_router.mini_lb; "
         "from sglang_router.router import Router; from sglang_router.version import __version__; "
         "assert __version__ == '0.3.2', __version__")
INSTALL_TIMEOUT = 900.0


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def works(python: Path) -> bool:
    """Whether `python` (a path, or a name on PATH) imports the peers as expected."""
    try:
        done = subprocess.run([str(python), "-c", CHECK], capture_output=True, timeout=60,
                              cwd="/")
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def ready(venv: Path) -> bool:
    python = python_of(venv)
    return python.exists() and works(python)


def ensure_venv(venv: Path = DEFAULT_VENV) -> Path:
    """The venv's python, after creating the venv and installing the peers if needed."""
    if ready(venv):
        return python_of(venv)
    print(f"peers: setting up {venv} ({' '.join(PACKAGES)})", flush=True)
    if not python_of(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(python_of(venv)), "-m", "pip", "install", "-q",
                    "--disable-pip-version-check", *PACKAGES],
                   check=True, timeout=INSTALL_TIMEOUT)
    if not ready(venv):
        raise RuntimeError(f"peers venv {venv} still fails: {CHECK}")
    return python_of(venv)


def peer_python(venv: Path, python: str | None = None) -> Path:
    """The interpreter that runs the peers: `python` as given (where sglang-router is
    installed beside our own packages, as on a machine without a registry), else the venv's,
    created if needed."""
    if python is None:
        return ensure_venv(venv)
    if not works(Path(python)):
        raise RuntimeError(f"{python} cannot run the peers: {CHECK}")
    return Path(python)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--peers-venv` and `--peers-python`, read back by `peer_python(args.peers_venv,
    args.peers_python)`: the flags every benchmark that runs the peers takes."""
    parser.add_argument("--peers-venv", type=Path, default=DEFAULT_VENV,
                        help="venv with sglang-router 0.3.2; created when missing")
    parser.add_argument("--peers-python", help="run the peers with this interpreter instead of "
                        "a venv (sglang_router importable there, e.g. python3 with PYTHONPATH)")
