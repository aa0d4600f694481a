"""Peak memory of the gateway under large request bodies: `python -m loadtests.body_memory`.

For each row a fresh gateway process (so its VmHWM, the kernel's high-water resident set, is
that row's own) serves N concurrent chat requests of one large body (default 30 MiB, in one
user message) in front of the PD stub (`loadtests.pdstub`, zero compute; `--backend sim`: the
simulator, which also answers `/v1/tokenize`), and the table shows
how far the gateway's resident set rose above where it stood just before: the peak (VmHWM
minus VmRSS before), that peak as a multiple of the bodies' total size, and what stayed
resident once every answer was in. `--base FOLDER` runs the same rows against the gateway of
another checkout (a folder holding its `gateway/`, e.g. `git worktree add /tmp/base COMMIT`),
one after the other on the same stub, for a before/after.

The stub reports a context length large enough for the body (`--context`, default 100 M
tokens), so the rows measure a body that is forwarded to both legs, not one the context
check refuses; `--context 131072` measures the refusal instead. The in-flight body budget is
raised to fit the largest row unless `--budget` says otherwise (a row over it shows its 503s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtests.launch import HOST, ROOT, free_port, running, stop_after
from loadtests.procstat import descendants
from loadtests.routing.cluster import SimServer

MIB = 1 << 20
# the stub with another context length in its /v1/models (its only model card)
_STUB = ("import sys, orjson, loadtests.pdstub as s; ctx = int(sys.argv.pop(1)); "
         "init = s.Server.__init__\n"
         "def patched(self, *a, **k):\n"
         "    init(self, *a, **k)\n"
         "    self.models = orjson.dumps({'object': 'list', 'data': [{'id': s.MODEL, "
         "'object': 'model', 'owned_by': 'pdstub', 'max_model_len': ctx}]})\n"
         "s.Server.__init__ = patched; s.main()")


@dataclass
class Row:
    target: str
    concurrent: int
    statuses: Counter
    before_mb: float
    peak_mb: float
    after_mb: float
    seconds: float


def status_kb(pid: int, key: str) -> int:
    """A `VmXXX:` figure of /proc/PID/status, summed over the process and its children."""
    total = 0
    for one in descendants(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{one}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    total += int(line.split()[1])
    return total


def chat_body(size: int) -> bytes:
    """A chat request of about `size` bytes: one user message of ASCII words."""
    words = b"lorem ipsum dolor sit amet consectetur adipiscing elit "
    head = b'{"model":"stub-model","max_tokens":4,"messages":[{"role":"user","content":"'
    tail = b'"}]}'
    fill = size - len(head) - len(tail)
    return head + (words * (fill // len(words) + 1))[:fill] + tail


async def post(port: int, path: str, body: bytes, timeout: float) -> int:
    """POST `body` on a new connection; the answer's status (0: no answer)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n"
                         % (path.encode(), HOST.encode(), len(body)))
            writer.write(body)
            await writer.drain()
            status_line = await reader.readline()
            await reader.read()  # to the close
        finally:
            writer.close()
    parts = status_line.split()
    return int(parts[1]) if len(parts) > 1 else 0


async def burst(port: int, body: bytes, concurrent: int, timeout: float) -> Counter:
    async def one() -> int | str:
        try:
            return await post(port, "/v1/chat/completions", body, timeout)
        except (OSError, TimeoutError) as exc:
            return type(exc).__name__
    return Counter(await asyncio.gather(*(one() for _ in range(concurrent))))


@contextlib.contextmanager
def servers(backend: str, context: int, log_dir: Path) -> Iterator[dict]:
    """One prefill and one decode server: the PD stub (one process) or two simulators."""
    ports = {"prefill": free_port(), "bootstrap": free_port(), "decode": free_port()}
    with contextlib.ExitStack() as stack:
        if backend == "stub":
            argv = [sys.executable, "-c", _STUB, str(context), "--host", HOST,
                    "--prefill-port", str(ports["prefill"]), "--bootstrap-port",
                    str(ports["bootstrap"]), "--decode-port", str(ports["decode"]),
                    "--pair-timeout", "60"]
            stack.enter_context(running("pdstub", argv, log_dir,
                                        f"http://{HOST}:{ports['prefill']}/health", cwd=ROOT))
        else:
            flags = ("--fast", "--context-length", str(context), "--log-level", "warning")
            for role in ("prefill", "decode"):
                sim = SimServer(role, ports[role],
                                ports["bootstrap"] if role == "prefill" else None)
                stack.enter_context(running(f"sim-{role}", sim.argv(*flags), log_dir,
                                            sim.url + "/health", cwd=ROOT))
        yield ports


def gateway_argv(base: Path | None, port: int, stub: dict, budget: int) -> list[str]:
    args = ["--host", HOST, "--port", str(port), "--log-level", "warning",
            "--prefill", f"http://{HOST}:{stub['prefill']}", str(stub["bootstrap"]),
            "--decode", f"http://{HOST}:{stub['decode']}"]
    if base is None:
        return [sys.executable, "-m", "gateway", *args, "--max-inflight-body-bytes",
                str(budget)]
    start = (f"import runpy, sys; sys.path.insert(0, {str(base.resolve())!r}); "
             "runpy.run_module('gateway', run_name='__main__', alter_sys=True)")
    return [sys.executable, "-c", start, *args]


def run_row(target: str, base: Path | None, stub: dict, body: bytes, concurrent: int,
            budget: int, log_dir: Path, timeout: float) -> Row:
    port = free_port()
    argv = gateway_argv(base, port, stub, budget)
    url = f"http://{HOST}:{port}"
    with running(f"gateway-{target}-{concurrent}", argv, log_dir, url + "/readiness") as gw:
        small = chat_body(2048)
        asyncio.run(burst(port, small, 2, timeout))  # warm: imports, connections, pools
        time.sleep(0.5)
        before = status_kb(gw.pid, "VmRSS")
        started = time.monotonic()
        statuses = asyncio.run(burst(port, body, concurrent, timeout))
        seconds = time.monotonic() - started
        time.sleep(1.0)  # the answers' own tasks finish and free
        peak = status_kb(gw.pid, "VmHWM")
        after = status_kb(gw.pid, "VmRSS")
    return Row(target, concurrent, statuses, before / 1024, (peak - before) / 1024,
               (after - before) / 1024, seconds)


def print_table(rows: list[Row], size: int) -> None:
    print(f"body {size / MIB:.1f} MiB; growth = gateway VmHWM - VmRSS before the burst")
    print(f"{'target':<8} {'conc':>4} {'statuses':<18} {'RSS before':>10} {'peak growth':>11} "
          f"{'x bodies':>8} {'kept after':>10} {'seconds':>7}")
    for r in rows:
        statuses = ",".join(f"{k}:{v}" for k, v in sorted(r.statuses.items(), key=str))
        times = r.peak_mb * MIB / (size * r.concurrent)
        print(f"{r.target:<8} {r.concurrent:>4} {statuses:<18} {r.before_mb:>7.0f} MB "
              f"{r.peak_mb:>8.0f} MB {times:>7.1f}x {r.after_mb:>7.0f} MB {r.seconds:>7.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.body_memory",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=30.0, help="body size in MiB")
    parser.add_argument("--concurrent", type=int, nargs="+", default=[1, 8],
                        help="rows: concurrent requests")
    parser.add_argument("--base", type=Path, default=None,
                        help="also run the gateway of this checkout (a folder with gateway/)")
    parser.add_argument("--base-only", action="store_true", help="only the --base rows")
    parser.add_argument("--backend", choices=("stub", "sim"), default="stub",
                        help="the PD stub (zero compute), or the simulator (/v1/tokenize too)")
    parser.add_argument("--context", type=int, default=100_000_000,
                        help="context length the stub reports (tokens)")
    parser.add_argument("--budget", type=int, default=None,
                        help="--max-inflight-body-bytes of this checkout's gateway "
                        "(default: room for the largest row)")
    parser.add_argument("--request-timeout", type=float, default=180.0)
    parser.add_argument("--timeout", type=float, default=1200.0, help="whole run, seconds")
    args = parser.parse_args(argv)
    if args.base is not None and not (args.base / "gateway").is_dir():
        raise SystemExit(f"--base {args.base}: no gateway/ folder there")
    stop_after(args.timeout)
    size = int(args.size_mib * MIB)
    body = chat_body(size)
    budget = args.budget or max(256 * MIB, (size + MIB) * max(args.concurrent))
    targets = [("base", args.base)] if args.base is not None else []
    if not args.base_only:
        targets.append(("this", None))
    rows = []
    with tempfile.TemporaryDirectory(prefix="body_memory-") as tmp:
        log_dir = Path(tmp)
        with servers(args.backend, args.context, log_dir) as stub:
            for concurrent in args.concurrent:
                for name, base in targets:
                    rows.append(run_row(name, base, stub, body, concurrent, budget, log_dir,
                                        args.request_timeout))
                    print(f"done: {name} x{concurrent}", file=sys.stderr, flush=True)
    print_table(rows, size)


if __name__ == "__main__":
    main()
