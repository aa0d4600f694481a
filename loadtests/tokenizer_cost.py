"""What gateway/tokens/tokenizer.py costs per request: encode and chat-render times for 100, 1k and
8k-token prompts, the thread-pool hop, and how long inline work stalls the event loop.

    python -m loadtests.tokenizer_cost MODEL_DIR   # e.g. the CPU rig's tiny model

Times are medians of repeated runs on this machine; the numbers in gateway/tokens/tokenizer.py's
docstring come from it. Not a test: nothing asserts a duration.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from gateway.tokens.tokenizer import load_tokenizer

WORDS = ("the quick brown fox jumps over the lazy dog prefill decode cache token request "
         "server gateway model route batch stream latency hello world tell me a story").split()


def text_of(tok, tokens: int) -> str:
    """A text of about `tokens` tokens for this tokenizer."""
    words: list[str] = []
    while True:
        words.extend(WORDS)
        text = " ".join(words)
        if len(tok.encode_text(text)) >= tokens:
            ids = tok.encode_text(text)[:tokens]
            return tok.backend.decode(ids)


def median_us(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


async def hop_us(pool: ThreadPoolExecutor, fn, repeat: int) -> float:
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(pool, fn)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        await loop.run_in_executor(pool, fn)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


async def loop_stall_ms(coro_factory, n: int) -> float:
    """Worst gap seen by a 1 ms ticker while `n` requests run."""
    gaps = []
    stop = False

    async def ticker():
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    await asyncio.gather(*(coro_factory() for _ in range(n)))
    stop = True
    await task
    return max(gaps) * 1e3


def gil_share(fn, seconds: float = 0.5) -> float:
    """Python work the main thread gets done while another thread loops on `fn`, relative to
    alone: ~1 when `fn` releases the GIL (and a core is free), well under 1 when it holds it."""
    def spin() -> int:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        return n

    alone = spin()
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            fn()

    thread = threading.Thread(target=worker)
    thread.start()
    shared = spin()
    stop.set()
    thread.join()
    return shared / alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    tok = load_tokenizer(args.model_dir)
    print(tok.describe())
    pool = ThreadPoolExecutor(max_workers=2)
    print(f"pool hop, empty function: {asyncio.run(hop_us(pool, lambda: None, args.repeat)):.0f} us")
    for tokens in (100, 1000, 8000):
        text = text_of(tok, tokens)
        body = {"messages": [{"role": "system", "content": "You are terse."},
                             {"role": "user", "content": text}]}
        encode = median_us(lambda t=text: tok.encode_text(t), args.repeat)
        render = median_us(lambda b=body: tok.render_chat(b), args.repeat)
        chat = median_us(lambda b=body: tok.encode_chat(b), args.repeat)
        hop = asyncio.run(hop_us(pool, lambda t=text: tok.encode_text(t), args.repeat))
        print(f"{tokens:>5} tokens ({len(text):>6} chars): encode {encode:8.0f} us, "
              f"chat render {render:6.0f} us, chat render+encode {chat:8.0f} us, "
              f"encode via the pool {hop:8.0f} us")
    for chars in (128, 256, 512, 1024, 2048, 4096):
        text = text_of(tok, 2000)[:chars]
        inline = median_us(lambda t=text: tok.encode_text(t), args.repeat)
        pooled = asyncio.run(hop_us(pool, lambda t=text: tok.encode_text(t), args.repeat))
        print(f"{chars:>5} chars: encode inline {inline:6.0f} us, via the pool {pooled:6.0f} us")
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 80,
              "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
             for i in range(4)]
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {
                             "name": "tool_0", "arguments": '{"a": "x"}'}}]},
                         {"role": "tool", "content": "r", "tool_call_id": "c"}], "tools": tools}
    print(f"4 tools, 4 turns: chat render {median_us(lambda: tok.render_chat(body), args.repeat):.0f} us")
    for tokens in (100, 8000):
        text = text_of(tok, tokens)

        async def inline(t=text):
            tok.encode_text(t)
            await asyncio.sleep(0)

        async def pooled(t=text):
            await asyncio.get_running_loop().run_in_executor(pool, tok.encode_text, t)

        print(f"{tokens:>5} tokens x 50 requests: worst event-loop gap inline "
              f"{asyncio.run(loop_stall_ms(inline, 50)):.1f} ms, via the pool "
              f"{asyncio.run(loop_stall_ms(pooled, 50)):.1f} ms")
    text = text_of(tok, 8000)
    print(f"main-thread Python work while a thread encodes 8k tokens: with encode() "
          f"{gil_share(lambda: tok.backend.encode(text)):.2f}, with encode_batch() "
          f"{gil_share(lambda: tok.backend.encode_batch([text])):.2f} (1.0 = unaffected)")
    tok.close()


if __name__ == "__main__":
    main()
