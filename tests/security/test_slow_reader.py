"""Slowloris on the response side: a client starts a stream and stops reading.

The `fast` gateway has `--send-timeout 1` (the default, 30 s, is checked as a value). The
client asks for a long stream whose chunks grow (cumulative text and top logprobs), shrinks
its receive buffer and never reads: the gateway's buffers fill, its sends wait, and within the
send timeout it must give up the stream, abort both PD legs on the servers and count a slow
client, while honest clients beside it are served normally.
"""

from __future__ import annotations

import asyncio
import os
import time

import orjson

from gateway.cancel import Interrupt
from gateway.config.settings import GatewayConfig
from gateway.dispatch.relay import StreamWatchdog
from gateway.errors import UpstreamError
from tests.security.honest import Honest, connect
from tests.security.rig import wait_for

SEND_TIMEOUT = 1.0  # the fast gateway's
TOKENS = 4000  # at 2 ms per token the natural stream lasts 8 s or more


def stalled_request(request_id: str, n: int = 1) -> bytes:
    sampling = {"max_new_tokens": TOKENS, **({"n": n} if n > 1 else {})}
    body = orjson.dumps({"text": "please write forever", "stream": True,
                         "sampling_params": sampling,
                         "return_logprob": True, "top_logprobs_num": 5})
    return (b"POST /generate HTTP/1.1\r\nhost: slow-reader\r\ncontent-type: application/json\r\n"
            b"x-request-id: " + request_id.encode() + b"\r\ncontent-length: %d\r\n\r\n"
            % len(body) + body)


def upstream_rid(sims, request_id: str) -> str:
    seen = [s for s in sims.decode.tap.seen("/generate") if s.header("x-request-id") == request_id]
    assert len(seen) == 1, seen
    return orjson.loads(seen[0].body)["rid"]


def test_a_client_that_stops_reading_loses_its_stream_and_both_legs(fast, fast_sims):
    assert GatewayConfig().send_timeout == 30.0
    slow = lambda: fast.metrics().total("gateway_slow_clients_total")  # noqa: E731
    before = slow()
    request_id = f"stalled-{os.urandom(4).hex()}"
    with Honest(fast, loops=2, minimum=10):
        sock = connect(fast.port, rcvbuf=4096)
        sock.sendall(stalled_request(request_id))
        started = time.monotonic()
        wait_for(lambda: any(s.header("x-request-id") == request_id  # other tests' too
                             for s in fast_sims.decode.tap.seen("/generate")),
                 10, "the stream reached the decode")
        took = wait_for(lambda: slow() > before, 20, "a slow client counted")
        rid = upstream_rid(fast_sims, request_id)
        wait_for(lambda: fast_sims.decode.rooms(rid), 10, "the decode ended the request")
        ended = time.monotonic() - started
    wait_for(lambda: fast.in_flight() == 0, 10, "the gateway's in-flight count is 0 again")
    sock.close()
    assert took < TOKENS * 0.002, f"the stream was cut only after {took:.1f}s"
    assert ended < TOKENS * 0.002
    outcome = fast_sims.decode.rooms(rid)[0]["outcome"]
    assert outcome in ("aborted", "cancelled"), outcome
    assert fast_sims.decode.stats()["in_flight"] == 0
    assert fast_sims.prefill.stats()["in_flight"] == 0
    posts = [orjson.loads(s.body) for s in fast_sims.decode.tap.seen("/abort_request", started)]
    assert {"rid": rid} in posts, "the decode was not told to abort"
    assert slow() == before + 1


def test_the_relay_watchdog_honours_a_send_timeout_shorter_than_the_idle_one():
    async def main() -> bool:
        victim = asyncio.get_running_loop().create_task(asyncio.sleep(5))
        client = Interrupt(victim)
        stalled = UpstreamError("stalled", leg="decode", server_url="u", retryable=True)
        watchdog = StreamWatchdog(idle=120.0, send=0.1, client=client, stalled=stalled)
        # a chunk was handed to a client that never takes it (what the relay writes)
        watchdog.since, watchdog.reading = watchdog.loop.time(), False
        await asyncio.sleep(0.5)
        watchdog.close()
        victim.cancel()
        return client.fired

    assert asyncio.run(main()), "the send deadline passed unnoticed"


def test_a_client_that_stops_reading_an_n2_stream_loses_it_and_every_leg(fast, fast_sims):
    """The same with n = 2: two sample streams merged through a small queue. Once the client
    stops reading, the queue fills and the samples' pumps wait on it; ending the stream must
    still stop them, close both samples' legs and free the request's place (a pump left
    waiting on the full queue kept the request in flight for good)."""
    request_id = f"stalled-n2-{os.urandom(4).hex()}"
    with Honest(fast, loops=2, minimum=10):
        sock = connect(fast.port, rcvbuf=4096)
        sock.sendall(stalled_request(request_id, n=2))
        wait_for(lambda: sum(s.header("x-request-id") == request_id
                             for s in fast_sims.decode.tap.seen("/generate")) == 2,
                 10, "both samples reached the decode")
        seen = [orjson.loads(s.body)["rid"] for s in fast_sims.decode.tap.seen("/generate")
                if s.header("x-request-id") == request_id]
        for rid in seen:
            wait_for(lambda rid=rid: fast_sims.decode.rooms(rid), 20,
                     f"the decode ended sample {rid}")
    wait_for(lambda: fast.in_flight() == 0, 10, "the gateway's in-flight count is 0 again")
    sock.close()
    for rid in seen:
        assert fast_sims.decode.rooms(rid)[0]["outcome"] in ("aborted", "cancelled")
    assert fast_sims.decode.stats()["in_flight"] == 0
    assert fast_sims.prefill.stats()["in_flight"] == 0
