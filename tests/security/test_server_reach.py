"""What a body may make the servers do: read their files, fetch URLs, run the caller's code.

SGLang reads a file its caller names as an image, video or audio input (`/dev/zero` too),
fetches a URL it names from inside the cluster, and with `--enable-custom-logit-processor`
runs the pickled callable a body carries (gateway/reach.py names the functions). Through the
gateway with its default flags a path on the servers' disks is refused (400), a media URL
and a logit processor need the operator's flag (403), and none of them reaches a server;
inline media (data: URIs, base64 images) pass, and honest clients are served throughout.
"""

from __future__ import annotations

import time

import pytest

from tests.security.honest import Honest
from tests.security.rig import start_gateway

FILE = "/etc/hostname-987654321"  # a reference that must never reach a server
URL = "http://169.254.169.254/latest-987654321"
INLINE = "data:image/png;base64,iVBORw0KGgo="
PROCESSOR = '{"callable": "80049587654321"}'


def chat(part: dict) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": "sim-model", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"}, part]}]}


def messages(source: dict) -> tuple[str, dict]:
    return "/v1/messages", {"model": "sim-model", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image", "source": source}]}]}


def responses(image: object) -> tuple[str, dict]:
    return "/v1/responses", {"model": "sim-model", "max_output_tokens": 2, "store": False,
                             "input": [{"role": "user", "content": [
                                 {"type": "input_text", "text": "look"},
                                 {"type": "input_image", "image_url": image}]}]}


def generate(**fields) -> tuple[str, dict]:
    return "/generate", {"text": "look", "sampling_params": {"max_new_tokens": 2}, **fields}


def reached(sims, since: float, mark: str) -> bool:
    return any(mark.encode() in s.body for s in sims.seen(since=since))


SERVER_FILES = {
    "generate image": generate(image_data=FILE),
    "generate image file URI": generate(image_data="file://" + FILE),
    "generate image in a batch list": generate(text=["a", "b"], image_data=[[INLINE], [FILE]]),
    "generate image object": generate(image_data=[{"url": FILE}]),
    "generate video bare": generate(video_data="clip-987654321.mp4"),
    "generate audio relative path": generate(audio_data="proc/self/environ987654321"),
    "chat image": chat({"type": "image_url", "image_url": {"url": "file://" + FILE}}),
    "chat image as a string": chat({"type": "image_url", "image_url": FILE}),
    "chat image with a text": chat({"type": "image_url", "text": "", "image_url": {"url": FILE}}),
    "chat video": chat({"type": "video_url", "video_url": {"url": "v-987654321.mp4"}}),
    "chat audio": chat({"type": "audio_url", "audio_url": {"url": FILE}}),
    "messages image": messages({"type": "url", "url": FILE}),
    "responses image": responses(FILE),
}


@pytest.mark.parametrize("name", SERVER_FILES)
def test_a_path_on_the_servers_is_refused(keyed, sims, name):
    path, body = SERVER_FILES[name]
    since = time.monotonic()
    with Honest(keyed, minimum=1):
        r = keyed.post(path, keyed.headers, json=body)
    assert r.status_code == 400, (name, r.text)
    assert "file on the servers" in r.text
    assert not reached(sims, since, "987654321")


FETCHED = {
    "generate image": generate(image_data=URL),
    "generate video": generate(video_data=[URL]),
    "chat image": chat({"type": "image_url", "image_url": {"url": URL}}),
    "chat audio": chat({"type": "audio_url", "audio_url": {"url": URL}}),
    "messages image": messages({"type": "url", "url": URL}),
    "responses image": responses({"url": URL}),
}


@pytest.mark.parametrize("name", FETCHED)
def test_a_media_url_needs_the_operators_flag(keyed, sims, name):
    path, body = FETCHED[name]
    since = time.monotonic()
    r = keyed.post(path, keyed.headers, json=body)
    assert r.status_code == 403, (name, r.text)
    assert "--allow-media-urls" in r.text
    assert not reached(sims, since, "987654321")


@pytest.mark.parametrize("path, body", [
    generate(custom_logit_processor=PROCESSOR),
    ("/v1/completions", {"model": "sim-model", "prompt": "x", "max_tokens": 2,
                         "custom_logit_processor": PROCESSOR}),
    ("/v1/chat/completions", {**chat({"type": "text", "text": "more"})[1],
                              "custom_logit_processor": PROCESSOR}),
])
def test_a_logit_processor_needs_the_operators_flag(keyed, sims, path, body):
    since = time.monotonic()
    r = keyed.post(path, keyed.headers, json=body)
    assert r.status_code == 403, (path, r.text)
    assert "--allow-custom-logit-processor" in r.text
    assert not reached(sims, since, "987654321")


@pytest.mark.parametrize("field", ["http_worker_ipc", "encoder_urls", "received_time"])
def test_fields_of_sglangs_own_processes_are_refused(keyed, sims, field):
    since = time.monotonic()
    path, body = generate(**{field: "ipc:///tmp/987654321"})
    r = keyed.post(path, keyed.headers, json=body)
    assert r.status_code == 400 and f"'{field}'" in r.text, r.text
    assert not reached(sims, since, "987654321")


def test_inline_media_pass(keyed, sims):
    since = time.monotonic()
    r = keyed.post(*chat({"type": ["image_url"], "text": "odd"})[:1], keyed.headers,
                   json=chat({"type": ["image_url"], "text": "odd"})[1])
    assert r.status_code < 500, r.text  # a part of an odd type is the server's to judge
    for path, body in (generate(image_data=INLINE), generate(image_data="iVBORw0KGgo="),
                       chat({"type": "image_url", "image_url": {"url": INLINE}}),
                       chat({"type": "input_audio", "input_audio": {"data": "UklGRg==",
                                                                    "format": "wav"}}),
                       messages({"type": "base64", "media_type": "image/png",
                                 "data": "iVBORw0KGgo="})):
        r = keyed.post(path, keyed.headers, json=body)
        assert r.status_code == 200, (path, r.text)
    assert reached(sims, since, INLINE)


def test_the_operator_may_allow_urls_and_processors(logs, sims):
    gateway = start_gateway(logs, "reach-allowed", sims,
                            ["--allow-media-urls", "--allow-custom-logit-processor"])
    try:
        since = time.monotonic()
        for path, body in (generate(image_data=URL), chat({"type": "image_url",
                                                           "image_url": {"url": URL}}),
                           generate(custom_logit_processor=PROCESSOR)):
            r = gateway.post(path, {}, json=body)
            assert r.status_code == 200, (path, r.text)
        assert reached(sims, since, URL) and reached(sims, since, "80049587654321")
        path, body = generate(image_data=FILE)
        r = gateway.post(path, {}, json=body)
        assert r.status_code == 400  # a path stays refused whatever the flags
    finally:
        gateway.stop()
