"""What the gateway's own code costs per request, without sockets: the ASGI app in this process,
its upstream replaced by one that answers at once, 64 requests at a time on one event loop.

    python -m loadtests.logic_cost                      # default policies, round robin, none
    python -m loadtests.logic_cost --requests 20000 --rounds 5 --endpoint chat
    python -m loadtests.logic_cost --endpoint chat-stream   # per relayed event too

The socket benchmark (`loadtests.overhead`) measures the whole proxy against its peers; this
one isolates the Python work of a request (parsing, admission, scheduling, both legs'
bookkeeping, accounting, the answer) from the kernel, the HTTP client and the peers, and
moves less from run to run. Configurations, side by side in one run:

* `default`: the shipped policies (cache_aware prefill, least_load decode);
* `round_robin`: `--policy round_robin`;
* `fixed`: the scheduler's choice replaced by a fixed alternation and its dispatch and
  completion hooks by nothing: what the policies cost is `default` minus this;
* `floor` (asked by name): the python-floor's app (loadtests/pd_floor.py), the least a PD
  proxy does, on the same clients and upstream: what the harness and a bare proxy cost;
* `worker` (asked by name): the default as worker 0 of `--workers 8`, its shared block
  attached (loadtests/worker_mode.py): what the workers' sharing adds to each request;
* the stages (asked by name: `endpoint`, `picked`, `counted`, `decode-leg`, `no-deadline`;
  loadtests/stages.py): the default request path cut short at a stage of its dispatch, for
  whole answers (generate, chat): what each part of the dispatch costs.

`--loads` keeps a fresh `/v1/loads` snapshot on every server (what `loadtests.pdstub` answers,
stamped each second as the gateway's poll would): the path a deployment runs, where the load
scores and the capacity test read the servers' figures. Without it (and in the figures before
2026-12-06) no snapshot is ever taken: the scores count the gateway's own requests alone.

`--without NAME,...` (or `all`) runs every configuration with those per-request mechanisms
replaced by nothing (loadtests/mechanisms.py): upper bounds of what each costs.

CPU time of this process per request (`time.process_time`), min and median over the rounds;
each round alternates the configurations so that a slow moment of the machine hits all of
them. Not a test: nothing asserts a duration.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from contextlib import nullcontext

import orjson

from gateway.app import build_app
from gateway.config.settings import load_config
from gateway.routes.server_protocol import CHUNKS, DEPARTURE, WHOLE, Departure
from loadtests import mechanisms, pd_floor, pdstub, stages, worker_mode

QUIET = ["--skip-probe", "--health-interval", "600", "--loads-interval", "0"]
DEFAULT_SERVERS = "1,2"  # `--servers`: loadtests.overhead's cluster


def servers(prefills: int = 1, decodes: int = 2) -> list[str]:
    """The gateway's flags for `prefills` prefill and `decodes` decode servers (the upstream
    answers them all in memory). The default, 1 + 2, is `loadtests.overhead`'s cluster;
    `loadtests.scaling` gives the proxy 5 + 5, where the policies weigh five candidates."""
    flags: list[str] = []
    for i in range(prefills):
        flags += ["--prefill", f"http://127.0.0.1:{1 + i}", str(9 + i)]
    for i in range(decodes):
        flags += ["--decode", f"http://127.0.0.1:{101 + i}"]
    return flags + QUIET


SERVERS = servers()
BODIES = {
    "generate": ("/generate", {"text": "Summarise the plot of a short story about a lighthouse "
                                       "keeper and a storm.",
                               "sampling_params": {"max_new_tokens": 2, "temperature": 0}}),
    "chat": ("/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": "Summarise the plot of a short story about a lighthouse "
                                    "keeper and a storm."}]}),
    "chat-stream": ("/v1/chat/completions", {"model": "m", "max_tokens": 64, "stream": True,
                                             "messages": [{"role": "user", "content": "Tell "
                                                           "me a long story."}]}),
}
STREAM_EVENTS = 64  # the chunks of a streamed answer, one event each, then [DONE]
ANSWERS = {
    "generate": {"text": " w01 w02", "meta_info": {"id": "x", "prompt_tokens": 17,
                                                   "completion_tokens": 2, "cached_tokens": 0,
                                                   "finish_reason": {"type": "length"}}},
    "chat": {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "finish_reason": "length",
                          "message": {"role": "assistant", "content": " w01 w02"}}],
             "usage": {"prompt_tokens": 17, "completion_tokens": 2, "total_tokens": 19}},
}
CONCURRENCY = 64
LOADS = pdstub.loads_answer(0)  # an idle server's `/v1/loads`, as the scaling stubs answer


def _events() -> list[bytes]:
    """A chat stream as SGLang sends it: one event per token, then [DONE]."""
    chunks = [b"data: " + orjson.dumps({
        "id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": f" w{i:02d}"}, "finish_reason": None}]})
        + b"\n\n" for i in range(STREAM_EVENTS)]
    return [*chunks, b"data: [DONE]\n\n"]


class _Answer:
    """An upstream answer already in memory (the `UpstreamResponse` shape); a stream hands
    out one event per loop turn, as a socket delivering them one by one would."""

    status = 200

    def __init__(self, body: bytes, events: list[bytes] | None = None) -> None:
        self._body: bytes | None = body
        self._events = list(events) if events is not None else None

    def header(self, name: bytes) -> bytes | None:
        if name != b"content-type":
            return None
        return b"application/json" if self._events is None else b"text/event-stream"

    async def next_chunk(self) -> bytes | None:
        if self._events is not None:
            if not self._events:
                return None
            await asyncio.sleep(0)
            return self._events.pop(0)
        body, self._body = self._body, None
        return body

    async def read(self) -> bytes:
        await asyncio.sleep(0)  # one loop turn, as a socket read would take
        return self._body or b""

    def abort(self) -> None:
        pass


class _Upstream:
    def __init__(self, answer: bytes, events: list[bytes] | None) -> None:
        self.answer = answer
        self.events = events

    async def post(self, base_url, path, body, request_id, headers=()) -> _Answer:
        await asyncio.sleep(0)
        streamed = self.events is not None and b"/generate" not in path.encode() \
            and b'"stream":true' in (body if isinstance(body, bytes) else bytes(body))
        return _Answer(self.answer, self.events if streamed else None)

    async def close(self) -> None:
        pass


class _NoPolicy:
    """A policy whose hooks do nothing (what `fixed` asks the proxy to tell)."""

    name = "fixed"

    def predicted_hit(self, target, view) -> None:
        return None

    def on_dispatch(self, target, view) -> None:
        pass

    def on_complete(self, target, view, success) -> None:
        pass


def _fixed_choice(gateway) -> None:
    """The scheduler without its policies: prefill 0, decodes in turn, no hooks."""
    scheduler = gateway.scheduler
    model = scheduler.models.only or next(iter(scheduler.models.known.values()))
    prefill, decodes = model.servers["prefill"][0], model.servers["decode"]
    turn = iter(range(1 << 62))
    scheduler.pick = lambda view, avoid=(), prefer=None: (
        prefill, decodes[next(turn) % len(decodes)])
    nothing = _NoPolicy()
    scheduler.policy = lambda role, target: nothing


CLOCKED = {"LatencyHistory.run", "Rebalancer._run", "Metrics.run_flusher"}


def _stop_clocked_loops() -> None:
    """Stop the loops that work per second, not per request (the status page's history, the
    rebalance loop, the metrics flusher): under valgrind a run's seconds move with the
    machine's load, and their share of a request moved `instruction_cost` by a few %."""
    for task in asyncio.all_tasks():
        if task.get_coro().__qualname__ in CLOCKED:
            task.cancel()


async def _polled(pool) -> None:
    """Every server's `/v1/loads` snapshot kept fresh, as the gateway's poll keeps it."""
    while True:
        for server in pool:
            server.apply_loads(LOADS, server.ask_loads())
        await asyncio.sleep(1.0)


async def _measure(config: str, endpoint: str, requests: int,
                   topology: list[str] = SERVERS, loads: bool = False) -> float:
    """CPU microseconds per request for one configuration (after a warm-up); `loads`: with
    fresh `/v1/loads` snapshots (`_polled`)."""
    streamed = endpoint.endswith("-stream")
    upstream = _Upstream(orjson.dumps(ANSWERS[endpoint.removesuffix("-stream")]),
                         _events() if streamed else None)
    if config == "floor":
        if streamed:
            raise ValueError("the floor relays no streams: --configs floor is for generate "
                             "and chat")
        app = pd_floor.build("http://127.0.0.1:1", 9, ["http://127.0.0.1:2",
                                                       "http://127.0.0.1:3"], client=upstream)
        return await _drive(config, app, endpoint, requests)
    staged = config in stages.STAGES
    if staged and streamed:
        raise ValueError(f"the stage {config} answers whole: it is for generate and chat")
    flags = ["--policy", "round_robin"] if config == "round_robin" else []
    with worker_mode.as_worker() if config == "worker" else nullcontext() as worker:
        app = build_app(load_config([*topology, *flags]), worker=worker)
        async with app.app.router.lifespan_context(app.app):
            gateway = app.state.gateway
            gateway.dispatcher.upstream = upstream
            if config == "fixed":
                _fixed_choice(gateway)
            _stop_clocked_loops()
            poll = asyncio.create_task(_polled(gateway.pool)) if loads else None
            try:
                with stages.cut(gateway, config, upstream.answer) if staged else nullcontext():
                    return await _drive(config, app, endpoint, requests)
            finally:
                if poll is not None:
                    poll.cancel()


async def _drive(config: str, app, endpoint: str, requests: int) -> float:
    """`CONCURRENCY` clients on `app`, a warm-up then the measured requests: CPU us each."""
    path, body = BODIES[endpoint]
    raw = orjson.dumps(body)
    headers = [(b"host", b"gw"), (b"content-type", b"application/json"),
               (b"content-length", str(len(raw)).encode())]
    answered = 0

    def whole(status, answer_headers, answer) -> bool:
        nonlocal answered
        answered += status == 200
        return True

    def chunks(body: bytes) -> bool:  # as UvicornSend.chunk: written at once
        nonlocal answered
        answered += body.endswith(b"data: [DONE]\n\n")
        return True

    async def receive() -> dict:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message) -> None:
        pass

    async def client(count: int) -> None:
        for _ in range(count):
            scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
                     "headers": headers, "query_string": b"", "http_version": "1.1",
                     "scheme": "http", "root_path": "", "client": ("127.0.0.1", 40000),
                     "server": ("127.0.0.1", 8000), DEPARTURE: Departure(), WHOLE: whole,
                     CHUNKS: chunks}
            await app(scope, receive, send)

    await asyncio.gather(*(client(20) for _ in range(CONCURRENCY)))  # warm-up
    per_client = max(1, requests // CONCURRENCY)
    answered = 0
    gc.collect()
    start = time.process_time()
    await asyncio.gather(*(client(per_client) for _ in range(CONCURRENCY)))
    spent = time.process_time() - start
    if answered != per_client * CONCURRENCY:
        raise RuntimeError(f"{config}: {answered} of {per_client * CONCURRENCY} answered 200")
    return spent / answered * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.logic_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=12800, help="measured requests per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--endpoint", choices=sorted(BODIES), default="generate")
    p.add_argument("--configs", default="default,round_robin,fixed",
                   help="of default, round_robin, fixed, floor, worker, or a stage "
                   f"({', '.join(stages.STAGES)})")
    p.add_argument("--without", default="", help="mechanisms replaced by nothing for the "
                   "whole run, comma-separated, or all (loadtests/mechanisms.py): upper "
                   "bounds of what each costs")
    p.add_argument("--servers", default=DEFAULT_SERVERS, help="prefill and decode servers, P,D "
                   "(default 1,2 as loadtests.overhead; 5,5 as loadtests.scaling)")
    p.add_argument("--loads", action="store_true", help="fresh /v1/loads snapshots on every "
                   "server, as a deployment polls them")
    args = p.parse_args(argv)
    try:
        stubs = mechanisms.names(args.without)
        prefills, decodes = (int(n) for n in args.servers.split(","))
        if prefills < 1 or decodes < 1:
            raise ValueError(f"--servers {args.servers}: at least one of each")
    except ValueError as exc:
        p.error(str(exc))
    topology = servers(prefills, decodes)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    results: dict[str, list[float]] = {c: [] for c in configs}
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)  # as the gateway runs (gateway/cli.py)
    try:
        with mechanisms.stubbed(stubs), asyncio.Runner(loop_factory=loop_factory) as runner:
            for _ in range(args.rounds):
                for config in configs:
                    results[config].append(runner.run(_measure(config, args.endpoint,
                                                               args.requests, topology,
                                                               args.loads)))
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
    base = statistics.median(results[configs[0]])
    per_event = STREAM_EVENTS + 1 if args.endpoint.endswith("-stream") else 0
    without = f" --without {','.join(stubs)}" if stubs else ""
    shape = f" --servers {args.servers}" if args.servers != DEFAULT_SERVERS else ""
    shape += " --loads" if args.loads else ""
    print(f"`python -m loadtests.logic_cost --endpoint {args.endpoint}{shape}{without}` "
          f"({args.requests} requests x {args.rounds} rounds, {CONCURRENCY} at a time)\n")
    extra = f" CPU us / event ({per_event} a stream, median) |" if per_event else ""
    print("| configuration | CPU us / request (min) | median | vs " + configs[0] + " |" + extra)
    print("|---|---|---|---|" + ("---|" if per_event else ""))
    for config, values in results.items():
        median = statistics.median(values)
        event = f" {median / per_event:.2f} |" if per_event else ""
        print(f"| {config} | {min(values):.1f} | {median:.1f} | {median / base:.2f}x |{event}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
