"""The compiled-hot-path trial: a copy of this checkout with the request path built by mypyc,
or the whole package (`--only policies`: the pick's modules alone) by Cython, to count what a
compiled build saves per request (docs/BENCHMARKS.md, "Compiled hot path").

    pip install mypy                                   # mypyc comes with it; needs a C compiler
    python -m loadtests.compiled_trial /tmp/compiled   # copy of HEAD, built in place there
    cd /tmp/compiled && python -m loadtests.instruction_cost --base /path/to/pure/checkout
    pip install cython && python -m loadtests.compiled_trial --compiler cython /tmp/cy
    python -m loadtests.compiled_trial --compiler cython --only policies /tmp/cyp
                                                       # the pick's modules alone (POLICIES)

The build goes into the copy, never into this checkout: an extension module beside its `.py`
is what Python imports, so a build here would keep running old code after an edit. The
gateway does not ship a compiled build (the trial did not pay); this keeps it reproducible.

MODULES are those of the request path that mypyc builds and that then run: mypyc does not
compile async generators (`dispatch/proxy.py`, `dispatch/relay.py`), dataclasses with an
`object` field fail at import (`servers/pool.py`, `dispatch/attempt.py`: `KeyError: 'object'`),
a class an interpreted one extends cannot be compiled (`routes/inference.py`), nor one that
extends a builtin (`cancel.py`). `_RETYPED` are the annotations the copy needs because mypyc
checks declared types at run time (each line raised TypeError on the first request).
`prefix/tree.py` and `request.py` need more than that (a parameter rebound to another type, a
one-element tuple type for any length) and are left out.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
MODULES = (
    "gateway/sse.py", "gateway/timers.py", "gateway/routes/asgi.py", "gateway/routes/answer.py",
    "gateway/observability/answer_tokens.py", "gateway/observability/usage.py",
    "gateway/dispatch/ledger.py", "gateway/dispatch/leg_bodies.py",
    "gateway/dispatch/inflight.py", "gateway/dispatch/stream_end.py",
    "gateway/dispatch/whole_body.py", "gateway/dispatch/pd.py",
)
_RETYPED = (  # (file, text, text in the copy)
    ("gateway/dispatch/attempt.py", "    payload: bytes\n", "    payload: object\n"),
    ("gateway/dispatch/attempt.py", '    prefill_payload: bytes = b""',
     '    prefill_payload: object = b""'),
    ("gateway/dispatch/pd.py", "        p_task = loop.create_task(",
     "        p_task: asyncio.Task[bytes] | None = loop.create_task("),
    ("gateway/timers.py", "        self._callback = callback\n        self._args = args\n",
     "        self._callback: Callable | None = callback\n"
     "        self._args: tuple | None = args\n"),
)
# Cython (pure-Python mode, untyped) compiles every module but these: Starlette's `Route`
# tells a handler from an ASGI app by `inspect.isfunction` (false for a compiled function),
# and `python -m` (the `--workers` supervisor starts its workers so) runs no compiled module.
CYTHON_PURE = ("gateway/app.py", "gateway/processes/worker_main.py")
CYTHON_DIRECTIVES = {"language_level": 3, "binding": True, "annotation_typing": False,
                     "embedsignature": False}
_CYTHON_SETUP = """
import glob, os
from setuptools import Extension, setup
from Cython.Build import cythonize
files = {only!r} or sorted(p for p in glob.glob("gateway/**/*.py", recursive=True)
                          if os.path.basename(p) not in ("__init__.py", "__main__.py")
                          and p not in {pure!r})
setup(name="gateway-cython-trial", script_args=["build_ext", "--inplace", "-j", "2"],
      ext_modules=cythonize([Extension(p[:-3].replace("/", "."), [p],
                                       extra_compile_args=["-O2", "-g0"]) for p in files],
                            compiler_directives={directives!r}, nthreads=2, quiet=True))
"""
# The pick's own modules: synchronous code (no coroutine for Cython to make slower on 3.12), what
# the cache-aware choice among several servers runs (docs/BENCHMARKS.md, "The pick compiled
# alone").
POLICIES = (
    "gateway/prefix/tree.py", "gateway/prefix/capacity.py", "gateway/prefix/placement.py",
    "gateway/prefix/shared.py", "gateway/policies/cache_aware.py",
    "gateway/policies/least_load.py", "gateway/scheduling/load.py", "gateway/servers/load.py",
)
# Findings of mypy's checker that are about annotations looser than the code (methods called
# on an `object` attribute, an Optional set by then); mypyc compiles them as generic access.
_RELAXED = ("attr-defined", "union-attr", "arg-type", "assignment", "return-value",
            "var-annotated", "misc", "has-type", "override", "exit-return", "index", "operator",
            "call-arg")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.compiled_trial", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", type=Path, help="an empty or missing folder for the copy")
    p.add_argument("--compiler", choices=("mypyc", "cython"), default="mypyc")
    p.add_argument("--only", choices=("policies",),
                   help="with --compiler cython: the pick's modules alone (POLICIES), not all")
    args = p.parse_args(argv)
    dest = args.dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        p.error(f"{dest} is not empty")
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=HERE, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    if args.compiler == "cython":
        only = list(POLICIES) if args.only == "policies" else []
        script = _CYTHON_SETUP.format(pure=CYTHON_PURE, directives=CYTHON_DIRECTIVES, only=only)
        return subprocess.run([sys.executable, "-c", script], cwd=dest).returncode
    for name, old, new in _RETYPED:
        path = dest / name
        text = path.read_text()
        if old not in text:
            print(f"{name}: the line to retype changed; update _RETYPED", file=sys.stderr)
            return 2
        path.write_text(text.replace(old, new, 1))
    command = [sys.executable, "-m", "mypyc", "--ignore-missing-imports",
               "--follow-imports=silent", *[f"--disable-error-code={c}" for c in _RELAXED],
               *MODULES]
    return subprocess.run(command, cwd=dest).returncode


if __name__ == "__main__":
    raise SystemExit(main())
