"""`ClientWatch` and the server protocol's `Departure`: a client's departure reaches the
request whether it comes before or after the watch is armed."""

from __future__ import annotations

import asyncio

import pytest

from gateway.cancel import Interrupt
from gateway.routes.answer import ClientWatch
from gateway.routes.asgi import ClientGone
from gateway.routes.server_protocol import DEPARTURE, Departure


async def _never() -> dict:
    raise AssertionError("under our protocol the watch never reads the receive channel")


def test_a_client_gone_before_the_watch_stops_the_request_as_it_is_armed():
    """Regression: the protocol called a callback nobody had set yet and kept nothing, so a
    client that left before the watch (a Responses turn waiting for its store, say) was
    never noticed: both legs ran for a client that was gone, no disconnect counted."""

    async def scenario() -> None:
        departure = Departure()
        scope = {DEPARTURE: departure}
        departure()  # the connection is lost before the endpoint arms its watch
        with pytest.raises(ClientGone):
            ClientWatch(Interrupt(), scope, _never)
        assert departure.callback is None

    asyncio.run(scenario())


def test_a_client_gone_while_watched_fires_the_interrupt_once():
    """The usual way, unchanged: the protocol calls the watch, which fires the request's
    interrupt; a second loss of the same connection tells nobody again."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        work = loop.create_task(asyncio.sleep(10))
        interrupt = Interrupt(work)
        departure = Departure()
        with ClientWatch(interrupt, {DEPARTURE: departure}, _never):
            departure()
            departure()
        with pytest.raises(asyncio.CancelledError):
            await work
        assert isinstance(interrupt.reason(), ClientGone)

    asyncio.run(scenario())


def test_a_departure_after_the_answer_was_sent_fires_nothing():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        work = loop.create_task(asyncio.sleep(0.01))
        interrupt = Interrupt(work)
        departure = Departure()
        with ClientWatch(interrupt, {DEPARTURE: departure}, _never) as watch:
            watch.done = True  # the answer is out
        departure()
        await work
        assert not interrupt.fired

    asyncio.run(scenario())
