"""Splitting a byte stream into SSE events (gateway/sse.py): any legal framing, cut anywhere.

SSE ends a line with "\r\n", "\n" or "\r" and an event with a blank line; the data of an
event in several lines is those lines joined by "\n". Each case is a stream in one framing and
the events it carries, as the splitter gives them (lines ended by "\n")."""

from __future__ import annotations

import pytest

from gateway.sse import NOT_JSON, EventSplitter, parsed, whole_events

EVENTS = [b'event: a\ndata: {"x":\ndata: 1}', b"data: [DONE]"]

FRAMINGS = [
    pytest.param(b'event: a\rdata: {"x":\rdata: 1}\r\rdata: [DONE]\r\r', id="cr"),
    pytest.param(b'event: a\r\ndata: {"x":\rdata: 1}\n\r\ndata: [DONE]\r\r\n', id="mixed"),
    pytest.param(b'event: a\ndata: {"x":\r\ndata: 1}\r\rdata: [DONE]\n\r', id="mixed-cr-last"),
]


@pytest.mark.parametrize("stream", FRAMINGS)
def test_a_stream_cut_anywhere_gives_its_events_whole(stream):
    for cut in range(len(stream) + 1):
        splitter = EventSplitter()
        events = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:])
        assert events == EVENTS, cut
    splitter = EventSplitter()
    assert [e for i in range(len(stream)) for e in splitter.feed(stream[i:i + 1])] == EVENTS


@pytest.mark.parametrize("stream", FRAMINGS)
def test_a_multi_line_data_is_its_lines_joined(stream):
    assert [obj for _, _, obj in parsed(EventSplitter(), stream)] == [{"x": 1}, NOT_JSON]


@pytest.mark.parametrize("stream", FRAMINGS)
def test_whole_events_pass_as_they_came(stream):
    """What is relayed keeps the server's bytes: only where the stream is cut moves."""
    for cut in range(len(stream) + 1):
        splitter = EventSplitter()
        out = splitter.whole(stream[:cut]) + splitter.whole(stream[cut:])
        assert out + splitter.rest() == stream and out.endswith((b"\n", b"\r")), cut
        assert splitter.feed(b"") == []


@pytest.mark.parametrize("data, whole", [
    pytest.param(b"data: 1\r\n", b"", id="one-line-end"),
    pytest.param(b"data: 1\r", b"", id="a-cr-that-may-start-a-crlf"),
    pytest.param(b"data: 1\r\n\r\ndata: 2\r\n", b"data: 1\r\n\r\n", id="crlf-blank-line"),
    pytest.param(b"data: 1\r\rdata: 2", b"data: 1\r\r", id="cr-blank-line"),
    pytest.param(b"data: 1\r\r\ndata: 2", b"data: 1\r\r\n", id="cr-then-crlf"),
])
def test_the_last_boundary(data, whole):
    assert whole_events(data) == (whole, data[len(whole):])
