"""What sending `input_ids` instead of text would save a real SGLang server, and cost us.

    python -m loadtests.input_ids_cost                  # CPU rig: one plain SGLang server
    python -m loadtests.input_ids_cost --requests 300 --words 600

With the served model's tokenizer loaded, the gateway knows each prompt's ids
(gateway/tokens/prompt_tokens.py) and could send them to SGLang as `input_ids`, sparing the server's
TokenizerManager its encode. This starts one plain SGLang server of the CPU rig
(/opt/sglang-rig, the tiny model: backends/sglang_cpu/make_tiny_model.py), sends the same
prompts as text and as ids (one new token each, one at a time, each prompt unique so the radix
cache does not hide the prefill), and reads the CPU time of the server's processes (the
HTTP/tokenizer process and the scheduler) per request; it also times the gateway's own encode
of those prompts. A GPU server prefills far faster than this CPU one, so what matters is the
tokenizer process's share, not the total.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from backends.launcher import BackgroundLauncher, topology_from_dict
from gateway.tokens.tokenizer import load_tokenizer
from loadtests.procstat import cpu_by_process

REPO = Path(__file__).resolve().parent.parent
TOPOLOGY = REPO / "deploy/cpu-rig/topology.yaml"
RIG = Path(os.environ.get("SGLANG_RIG_DIR", "/opt/sglang-rig"))


def prompts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = "the quick brown fox jumps over lazy dog hello world tell me a story".split()
    return [f"{i} " + " ".join(rng.choice(vocab) for _ in range(words)) for i in range(count)]


def server_cpu(root: int) -> dict[str, float]:
    """CPU seconds of the server's processes by kind: SGLang names its scheduler and
    detokenizer processes (`sglang::scheduler`, `sglang::detokenizer`); the rest is the HTTP
    server with the TokenizerManager."""
    out = {"main": 0.0, "scheduler": 0.0, "detokenizer": 0.0}
    for pid, seconds in cpu_by_process(root).items():
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        kind = next((k for k in ("scheduler", "detokenizer") if k in name), "main")
        out[kind] += seconds
    return out


def measure(url: str, root: int, bodies: list[dict]) -> tuple[float, dict[str, float]]:
    """Seconds of wall time, and CPU seconds per kind of server process over the bodies."""
    before = server_cpu(root)
    started = time.monotonic()
    with httpx.Client(timeout=120) as client:
        for body in bodies:
            client.post(url + "/generate", json=body).raise_for_status()
    after = server_cpu(root)
    return time.monotonic() - started, {k: after[k] - before[k] for k in after}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.input_ids_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--words", type=int, default=400, help="words per prompt (~1 token each)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="input-ids-"))
    model = work / "model"
    subprocess.run([str(RIG / "venv/bin/python"),
                    str(REPO / "backends/sglang_cpu/make_tiny_model.py"), str(model)],
                   check=True, capture_output=True, timeout=300)
    spec = yaml.safe_load(TOPOLOGY.read_text())
    spec.update(model_path=str(model), model_name="tiny", log_dir=str(work / "logs"),
                prefill=0, decode=0, plain=1, readiness_timeout_s=300)
    launcher = BackgroundLauncher(topology_from_dict(
        spec, variables={**os.environ, "TOPOLOGY_DIR": str(TOPOLOGY.parent)}), progress=True)
    launcher.start()
    tokenizer = load_tokenizer(model)
    try:
        server = launcher.servers[0]
        texts = prompts(2 * args.requests + 20, args.words, seed=1)
        encode_started = time.perf_counter()
        ids = [tokenizer.encode_text(t) for t in texts]
        encode_us = (time.perf_counter() - encode_started) / len(texts) * 1e6
        params = {"max_new_tokens": 1, "temperature": 0}
        warm = [{"text": t, "sampling_params": params} for t in texts[:20]]
        measure(server.url, server.pid, warm)
        n = args.requests
        as_text = [{"text": t, "sampling_params": params} for t in texts[20:20 + n]]
        as_ids = [{"input_ids": i, "sampling_params": params} for i in ids[20 + n:20 + 2 * n]]
        rows = []
        for name, bodies in (("text", as_text), ("input_ids", as_ids)):
            wall, cpu = measure(server.url, server.pid, bodies)
            main_cpu, rest = cpu["main"], cpu["scheduler"] + cpu["detokenizer"]
            rows.append((name, wall / n * 1e3, main_cpu / n * 1e3, rest / n * 1e3,
                         sum(len(str(b)) for b in bodies) / n))
        tokens = sum(len(i) for i in ids) / len(ids)
        print(f"\n{n} requests each, prompts of ~{tokens:.0f} tokens, 1 new token, one at a time;"
              f" SGLang CPU rig (tiny model), {sys.platform}")
        print("| prompt sent as | wall ms / req | HTTP+tokenizer process CPU ms / req | "
              "scheduler + detokenizer CPU ms / req | request body bytes |")
        print("|---|---|---|---|---|")
        for name, wall, main_cpu, rest, size in rows:
            print(f"| {name} | {wall:.2f} | {main_cpu:.3f} | {rest:.3f} | {size:.0f} |")
        print(f"\ngateway encode of the same prompts: {encode_us:.0f} us each "
              "(done anyway when a tokenizer is loaded)")
    finally:
        tokenizer.close()
        launcher.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
