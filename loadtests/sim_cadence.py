"""Does a simulated decode step as often as its timing profile says, with many streams?

    python -m loadtests.sim_cadence                     # 1, 25, 100 streams, ~30 s
    python -m loadtests.sim_cadence --streams 100 --sim-root /tmp/older-checkout

One prefill and one decode simulator (`--timing h200-llama3-8b`) behind our gateway; N
concurrent `/generate` streams of `--tokens` tokens each. Prints, per N, the mean gap between
the chunks a client receives (its mean inter-token latency) against the profile's decode
step for that batch and context (`TimingProfile.decode_ms`): a ratio near 1.0 means the
streaming work between two steps does not slow the modelled GPU (docs/SIMULATOR.md, "Timing
model"). `--sim-root` runs the simulators of another checkout, for a before/after.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from backends.sim.timing import H200_LLAMA3_8B
from loadtests.launch import HOST, ROOT, free_port, running

PROMPT_WORDS = 200  # the sim's tokenizer: about one token per word


async def _stream(client: httpx.AsyncClient, url: str, i: int, tokens: int) -> float | None:
    body = {"text": " ".join(f"s{i}w{j}" for j in range(PROMPT_WORDS)), "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
    first = last = None
    chunks = 0
    async with client.stream("POST", url + "/generate", json=body) as answer:
        async for line in answer.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                last = time.perf_counter()
                first = first or last
                chunks += 1
    return (last - first) / (chunks - 1) if first and last and chunks > 1 else None


async def _mean_itl(url: str, streams: int, tokens: int) -> float:
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        gaps = await asyncio.gather(*(_stream(client, url, i, tokens) for i in range(streams)))
    return statistics.mean(g for g in gaps if g is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.sim_cadence", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,25,100", help="comma-separated N")
    parser.add_argument("--tokens", type=int, default=300, help="tokens per stream")
    parser.add_argument("--sim-root", type=Path, default=ROOT, help="checkout of the sims")
    args = parser.parse_args(argv)
    p_port, boot, d_port, g_port = free_port(), free_port(), free_port(), free_port()
    timing = ["--timing", H200_LLAMA3_8B.name]
    sim = [sys.executable, "-m", "backends.sim", "--host", HOST]
    gateway = [sys.executable, "-m", "gateway", "--host", HOST, "--port", str(g_port),
               "--log-level", "warning", "--prefill", f"http://{HOST}:{p_port}", str(boot),
               "--decode", f"http://{HOST}:{d_port}"]
    rows = []
    with tempfile.TemporaryDirectory() as logs, \
            running("prefill", [*sim, "--mode", "prefill", "--port", str(p_port),
                                "--bootstrap-port", str(boot), *timing], Path(logs),
                    f"http://{HOST}:{p_port}/health", cwd=args.sim_root), \
            running("decode", [*sim, "--mode", "decode", "--port", str(d_port), *timing],
                    Path(logs), f"http://{HOST}:{d_port}/health", cwd=args.sim_root), \
            running("gateway", gateway, Path(logs), f"http://{HOST}:{g_port}/readiness"):
        for n in (int(x) for x in args.streams.split(",")):
            itl = asyncio.run(_mean_itl(f"http://{HOST}:{g_port}", n, args.tokens))
            context = n * (PROMPT_WORDS + args.tokens // 2)
            model = H200_LLAMA3_8B.decode_ms(n, context) / 1e3
            rows.append((n, itl, model))
    print("| streams | mean ITL ms | profile decode step ms | ratio |\n|---|---|---|---|")
    for n, itl, model in rows:
        print(f"| {n} | {itl * 1e3:.2f} | {model * 1e3:.2f} | {itl / model:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
