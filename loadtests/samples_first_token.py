"""How long an n > 1 stream waits for its first event, against n = 1, through the gateway.

    python -m loadtests.samples_first_token                    # n = 1, 2, 4; ~20 s
    python -m loadtests.samples_first_token --base /tmp/older-checkout --rounds 3

One prefill and two decode simulators on a GPU timing profile (`--timing`, default
h200-qwen2.5-32b) behind the gateway; one chat stream at a time (a 1,000-word prompt, 32
tokens), `--requests` per n. The gateway sends the samples of n > 1 as n requests, the later
ones after sample 0's prefill (gateway/dispatch/parallel_samples.py), so its merged stream's
first event says whether the client waits for the slowest sample's first token. `--base`
runs the gateway of another checkout on the same simulators, alternating with this one, for
a before/after. Prints, per gateway and n, the median first event and whole stream (ms).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from loadtests.launch import HOST, ROOT, free_port, running

PROMPT_WORDS = 1000  # the simulator's tokenizer: about one token per word
TOKENS = 32


def _stream(client: httpx.Client, url: str, n: int, tag: str) -> tuple[float, float]:
    """(first event, whole stream) in seconds for one chat stream with `n` samples, on a
    prompt of its own (`tag`, of one length for every stream compared: nothing of it is
    cached anywhere, and the simulator's tokens follow the characters)."""
    words = " ".join(f"{tag}w{j}" for j in range(PROMPT_WORDS))
    body = {"model": "m", "messages": [{"role": "user", "content": words}], "n": n,
            "stream": True, "max_tokens": TOKENS}
    start = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"n={n}: status {answer.status_code}: {answer.read()!r}")
        for line in answer.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"n={n}: the stream had no event")
    return first, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.samples_first_token",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="1,2,4", help="samples per request, comma-separated")
    p.add_argument("--requests", type=int, default=10, help="streams per n and round")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--timing", default="h200-qwen2.5-32b", help="the simulators' profile")
    p.add_argument("--base", type=Path, help="another checkout whose gateway runs too")
    args = p.parse_args(argv)
    ns = [int(x) for x in args.n.split(",")]
    trees = {"gateway": ROOT, **({"base": args.base.resolve()} if args.base else {})}
    p_port, boot, d_ports = free_port(), free_port(), [free_port(), free_port()]
    sim = [sys.executable, "-m", "backends.sim", "--host", HOST, "--timing", args.timing]
    firsts: dict[tuple[str, int], list[float]] = {}
    wholes: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as logs, ExitStack() as stack:
        stack.enter_context(running(
            "prefill", [*sim, "--mode", "prefill", "--port", str(p_port),
                        "--bootstrap-port", str(boot)], Path(logs),
            f"http://{HOST}:{p_port}/health"))
        for k, port in enumerate(d_ports):
            stack.enter_context(running(f"decode-{k}", [*sim, "--mode", "decode", "--port",
                                                        str(port)], Path(logs),
                                        f"http://{HOST}:{port}/health"))
        servers = ["--prefill", f"http://{HOST}:{p_port}", str(boot),
                   *(x for port in d_ports for x in ("--decode", f"http://{HOST}:{port}"))]
        for round_ in range(args.rounds):
            for t, (name, tree) in enumerate(trees.items()):
                port = free_port()
                gateway = [sys.executable, "-m", "gateway", "--host", HOST, "--port",
                           str(port), "--log-level", "warning", *servers]
                with running(f"{name}-{round_}", gateway, Path(logs),
                             f"http://{HOST}:{port}/readiness", cwd=tree), \
                        httpx.Client(timeout=60, trust_env=False) as client:
                    url = f"http://{HOST}:{port}"
                    _stream(client, url, 1, f"t{t}r{round_}warm")
                    for n in ns:
                        for i in range(args.requests):
                            first, whole = _stream(client, url, n, f"t{t}r{round_}n{n}x{i}")
                            firsts.setdefault((name, n), []).append(first)
                            wholes.setdefault((name, n), []).append(whole)
    print(f"profile {args.timing}; {PROMPT_WORDS}-word prompts, {TOKENS} tokens, one stream "
          "at a time; medians in ms\n")
    print("| gateway | n | streams | first event | vs n = 1 | whole stream |\n"
          "|---|---|---|---|---|---|")
    for name in trees:
        alone = statistics.median(firsts[(name, ns[0])])
        for n in ns:
            first = statistics.median(firsts[(name, n)])
            print(f"| {name} | {n} | {len(firsts[(name, n)])} | {first * 1e3:.1f} | "
                  f"{first / alone:.2f}x | {statistics.median(wholes[(name, n)]) * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
