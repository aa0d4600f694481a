"""Measure the GPU physics the simulator's timing model stands on (issue 24).

    python3 loadtests/gpu_calibrate.py --out h200.json          # on the GPU machine
    python3 loadtests/gpu_calibrate.py --tiny --out /tmp/t.json  # syntax check on CPU

A decoder of Llama-3-8B's shape (and, unless --no-large, Qwen2.5-32B's on a smaller grid) is
built from the config below with random bf16 weights: nothing is downloaded and no serving
engine is needed, only torch. It times what SGLang's scheduler runs:

- prefill (`ScheduleBatch` in extend mode, `ModelRunner.forward_extend`): one sequence of N new
  tokens after C cached tokens whose KV is already in the pool; attention over cached + new
  (torch SDPA, lower-right causal), logits for the last token only;
- decode (`ModelRunner.forward_decode` replayed from a CUDA graph, one graph per batch size as
  SGLang's `CudaGraphRunner` captures them): one token for each of B sequences of T context
  tokens, logits for every sequence.

Each point is the median of several timed runs after warm-up, torch.cuda.synchronize() around
each. The decode KV buffer of one layer is reused by every layer when all layers' KV would not
fit a 48 GiB budget: one layer's KV at those sizes (> 1.5 GiB) is far beyond L2, so the bytes read per
step are what distinct buffers would cost.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass

if sys.path and sys.path[0].rstrip("/").endswith("loadtests"):
    # run as a file: loadtests/profile.py would shadow the stdlib module torch imports
    sys.path.pop(0)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """The model config: what a HuggingFace config.json of the family would say."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    rope_theta: float = 500000.0

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token (SGLang's MHATokenToKVPool cell)."""
        return self.layers * self.kv_heads * self.head_dim * 2 * dtype_bytes


LLAMA3_8B = Shape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256)
QWEN25_32B = Shape("qwen2.5-32b", 64, 5120, 40, 8, 128, 27648, 152064, 1000000.0)
TINY = Shape("tiny", 2, 256, 4, 2, 64, 512, 1000)

FULL_GRID = {
    "prefill_new": [256, 512, 1024, 2048, 4096, 8192, 16384],
    "prefill_cached": [0, 2048, 8192],
    "decode_batch": [1, 8, 32, 64, 128, 256],
    "decode_ctx": [512, 1024, 4096, 8192],
}
LARGE_GRID = {
    "prefill_new": [256, 1024, 4096, 16384],
    "prefill_cached": [0, 8192],
    "decode_batch": [1, 32, 128],
    "decode_ctx": [1024, 4096],
}
TINY_GRID = {"prefill_new": [16, 32], "prefill_cached": [0, 16],
             "decode_batch": [1, 2], "decode_ctx": [32, 64]}


class Model:
    """Weights as plain tensors and the two forward passes SGLang's model runner performs."""

    def __init__(self, shape: Shape, device: str, dtype: torch.dtype) -> None:
        self.s, self.device, self.dtype = shape, device, dtype
        s = shape

        def w(*size: int) -> torch.Tensor:
            return torch.empty(*size, device=device, dtype=dtype).normal_(0.0, 0.02)

        self.embed = w(s.vocab, s.hidden)
        self.lm_head = w(s.vocab, s.hidden)
        self.final_norm = torch.ones(s.hidden, device=device, dtype=dtype)
        q_out, kv_out = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.layers = [{
            "in_norm": torch.ones(s.hidden, device=device, dtype=dtype),
            "qkv": w(q_out + 2 * kv_out, s.hidden),
            "o": w(s.hidden, q_out),
            "post_norm": torch.ones(s.hidden, device=device, dtype=dtype),
            "gate_up": w(2 * s.mlp, s.hidden),
            "down": w(s.hidden, s.mlp),
        } for _ in range(s.layers)]
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=device).float()
                                      / s.head_dim))
        self.inv_freq = inv
        self.attention = _attn_native  # choose_attention() may swap in the fallback

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _qkv(self, layer: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [B, S, hidden] -> q [B, H, S, D], k and v [B, KV, S, D], RoPE applied."""
        s = self.s
        b, n, _ = x.shape
        h = F.rms_norm(x, (s.hidden,), layer["in_norm"], 1e-5)
        q, k, v = (h @ layer["qkv"].t()).split(
            [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
        q = q.view(b, n, s.heads, s.head_dim).transpose(1, 2)
        k = k.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
        v = v.view(b, n, s.kv_heads, s.head_dim).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _mlp(self, layer: dict, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, n = x.shape[:2]
        x = x + attn.transpose(1, 2).reshape(b, n, -1) @ layer["o"].t()
        h = F.rms_norm(x, (self.s.hidden,), layer["post_norm"], 1e-5)
        gate, up = (h @ layer["gate_up"].t()).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ layer["down"].t()

    def extend(self, ids: torch.Tensor, cached: int, caches: list) -> torch.Tensor:
        """Prefill `ids` [1, N] after `cached` tokens whose KV sits in `caches` (per layer)."""
        n = ids.shape[1]
        cos, sin = self.rope(torch.arange(cached, cached + n, device=self.device))
        x = self.embed[ids]
        for layer, (kc, vc) in zip(self.layers, caches, strict=True):
            q, k, v = self._qkv(layer, x, cos, sin)
            kc[:, :, cached:cached + n] = k
            vc[:, :, cached:cached + n] = v
            attn = self.attention(q, kc[:, :, :cached + n], vc[:, :, :cached + n], cached)
            x = self._mlp(layer, x, attn)
        last = F.rms_norm(x[:, -1], (self.s.hidden,), self.final_norm, 1e-5)
        return last @ self.lm_head.t()

    def decode(self, ids: torch.Tensor, pos: torch.Tensor, caches: list, ctx: int):
        """One token for each of B sequences (ids [B, 1]) at position ctx - 1."""
        cos, sin = self.rope(pos)
        x = self.embed[ids]
        for i, layer in enumerate(self.layers):
            kc, vc = caches[i % len(caches)]
            q, k, v = self._qkv(layer, x, cos, sin)
            kc[:, :, ctx - 1:ctx] = k
            vc[:, :, ctx - 1:ctx] = v
            attn = F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)
            x = self._mlp(layer, x, attn)
        h = F.rms_norm(x[:, -1], (self.s.hidden,), self.final_norm, 1e-5)
        return h @ self.lm_head.t()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _attn_native(q, k, v, cached: int):
    """Causal attention of the new tokens over cached + new, GQA in the kernel."""
    if cached == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    bias = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)


def _attn_expanded(q, k, v, cached: int):
    """The fallback: KV heads repeated to the query heads (an extra copy per layer)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if cached == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    bias = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def choose_attention(model: Model) -> str:
    """Keep GQA inside the kernel if this torch gives it right with a lower-right mask."""
    q = torch.randn(1, 8, 16, 128, device=model.device, dtype=model.dtype)
    kv = torch.randn(1, 2, 48, 128, device=model.device, dtype=model.dtype)
    try:
        ref = _attn_expanded(q, kv, kv, 32)
        got = _attn_native(q, kv, kv, 32)
        if torch.allclose(ref.float(), got.float(), atol=2e-2, rtol=2e-2):
            return "sdpa-gqa-lower-right"
        print("GQA with a lower-right mask disagrees; expanding KV heads", file=sys.stderr)
    except (RuntimeError, TypeError) as exc:
        print(f"GQA with a lower-right mask refused ({exc}); expanding KV heads", file=sys.stderr)
    model.attention = _attn_expanded
    return "sdpa-expanded-kv"


def copy_bandwidth(device: str) -> float | None:
    """GB/s of a 1 GiB device-to-pinned-host copy: a stand-in for one 400 Gb/s RDMA NIC."""
    if device != "cuda":
        return None
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    ms = timed(lambda: dst.copy_(src, non_blocking=True), device, 1, 3)
    return round(2**30 / (statistics.median(ms) / 1e3) / 1e9, 1)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, warmup: int, runs: int) -> list[float]:
    """Milliseconds of `fn()` per run, synchronized around each."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure_prefill(model: Model, grid: dict, runs: int) -> list[dict]:
    s, dev = model.s, model.device
    rows = []
    for cached in grid["prefill_cached"]:
        for new in grid["prefill_new"]:
            total = cached + new
            caches = [(torch.zeros(1, s.kv_heads, total, s.head_dim, device=dev, dtype=model.dtype),
                       torch.zeros(1, s.kv_heads, total, s.head_dim, device=dev, dtype=model.dtype))
                      for _ in range(s.layers)]
            ids = torch.randint(0, s.vocab, (1, new), device=dev)
            step = functools.partial(model.extend, ids, cached, caches)
            with torch.inference_mode():
                ms = timed(step, dev, 2, runs if new < 8192 else max(3, runs // 2))
            med = statistics.median(ms)
            rows.append({"new": new, "cached": cached, "ms": round(med, 3),
                         "min_ms": round(min(ms), 3), "tokens_per_s": round(new / med * 1e3)})
            print(f"prefill new={new:6d} cached={cached:5d}: {med:8.2f} ms "
                  f"({new / med * 1e3:8.0f} tok/s)", flush=True)
            del caches
    return rows


def _decode_runner(model: Model, batch: int, ctx: int, kv_budget: float):
    """A callable replaying one decode step; a CUDA graph on GPU, eager on CPU."""
    s, dev = model.s, model.device
    per_layer = batch * ctx * s.kv_bytes_per_token() / s.layers
    distinct = max(1, min(s.layers, int(kv_budget // max(per_layer, 1))))
    caches = [(torch.zeros(batch, s.kv_heads, ctx, s.head_dim, device=dev, dtype=model.dtype),
               torch.zeros(batch, s.kv_heads, ctx, s.head_dim, device=dev, dtype=model.dtype))
              for _ in range(distinct)]
    ids = torch.randint(0, s.vocab, (batch, 1), device=dev)
    pos = torch.full((1,), ctx - 1, device=dev, dtype=torch.long)

    def step():
        return model.decode(ids, pos, caches, ctx)

    if dev != "cuda":
        return step, distinct, caches
    try:
        return _capture(step, distinct, caches)
    except RuntimeError as exc:  # keep the point, eager, rather than lose the run
        print(f"CUDA graph capture failed at batch {batch} ctx {ctx}: {exc}", file=sys.stderr)
        torch.cuda.synchronize()
        return step, -distinct, caches


def _capture(step, distinct: int, caches: list):
    """Record one decode step as a CUDA graph after two eager warm-ups on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        step()
    return graph.replay, distinct, (caches, graph)


def measure_decode(model: Model, grid: dict, runs: int, kv_budget: float) -> list[dict]:
    rows = []
    for ctx in grid["decode_ctx"]:
        for batch in grid["decode_batch"]:
            fn, distinct, keep = _decode_runner(model, batch, ctx, kv_budget)
            with torch.inference_mode():
                ms = timed(fn, model.device, 3, runs)
            med = statistics.median(ms)
            rows.append({"batch": batch, "ctx": ctx, "ms": round(med, 3),
                         "min_ms": round(min(ms), 3), "kv_buffers": abs(distinct),
                         "cuda_graph": model.device == "cuda" and distinct > 0,
                         "tokens_per_s": round(batch / med * 1e3)})
            print(f"decode batch={batch:4d} ctx={ctx:5d}: {med:7.2f} ms "
                  f"({batch / med * 1e3:7.0f} tok/s, {distinct} KV buffers)", flush=True)
            del fn, keep
            if model.device == "cuda":
                torch.cuda.empty_cache()
    return rows


def calibrate(shape: Shape, grid: dict, device: str, runs: int, kv_budget: float) -> dict:
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = Model(shape, device, dtype)
    params = sum(t.numel() for t in (model.embed, model.lm_head)) + sum(
        t.numel() for layer in model.layers for t in layer.values())
    path = choose_attention(model)
    print(f"== {shape.name}: {params / 1e9:.2f} B parameters, attention {path}", flush=True)
    result = {
        "shape": asdict(shape), "parameters": params, "dtype": str(dtype).split(".")[-1],
        "kv_bytes_per_token": shape.kv_bytes_per_token(), "attention": path,
        "prefill": measure_prefill(model, grid, runs),
        "decode": measure_decode(model, grid, runs, kv_budget),
    }
    result["seconds"] = round(time.perf_counter() - t0, 1)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def device_info(device: str) -> dict:
    info = {"torch": torch.__version__, "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="where the JSON table goes")
    parser.add_argument("--tiny", action="store_true", help="2-layer toy on CPU (syntax check)")
    parser.add_argument("--runs", type=int, default=7, help="timed runs per point")
    parser.add_argument("--no-large", action="store_true", help="skip the 32B shape")
    parser.add_argument("--large-budget-s", type=float, default=210.0,
                        help="skip the 32B shape when the 8B took longer than this")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if device == "cpu" and not args.tiny:
        parser.error("no GPU here: use --tiny for a syntax check")
    started = time.perf_counter()
    kv_budget = 48 * 2**30 if device == "cuda" else 2**30
    results = {"info": device_info(device), "runs_per_point": args.runs,
               "d2h_copy_gbps": copy_bandwidth(device), "models": {}}
    first = TINY if args.tiny else LLAMA3_8B
    results["models"][first.name] = calibrate(
        first, TINY_GRID if args.tiny else FULL_GRID, device, args.runs, kv_budget)
    with open(args.out, "w") as fh:  # the 8B table survives a failure of the large shape
        json.dump(results, fh, indent=1)
    spent = time.perf_counter() - started
    if not args.tiny and not args.no_large and spent < args.large_budget_s:
        try:
            results["models"][QWEN25_32B.name] = calibrate(
                QWEN25_32B, LARGE_GRID, device, max(3, args.runs - 2), kv_budget)
        except RuntimeError as exc:  # out of memory or a kernel refusal: keep the 8B table
            print(f"{QWEN25_32B.name} failed: {exc}", file=sys.stderr)
    results["total_seconds"] = round(time.perf_counter() - started, 1)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"total {results['total_seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
