"""The gateway's token ids (gateway/tokens/tokenizer.py) equal those real SGLang 0.5.23 computes.

Against the session's plain server (the tiny model) and a second plain server of a variant
model (a tool-calling chat template, a BOS-adding post-processor, added tokens), each id list
is compared with the one the generation path itself reports: `/generate` with
`return_prompt_token_ids`, `/v1/completions` with `return_token_ids`, `/v1/chat/completions`
with `return_prompt_token_ids` (plus `usage.prompt_tokens`). Tokenizer-file variants are also
checked without a server, against SGLang's own `get_tokenizer` run by the rig's python.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.tokens.tokenizer import (
    GatewayTokenizer,
    RejectedRequest,
    load_tokenizer,
    tokenizer_path_from_model_info,
)
from tests.e2e_sglang.conftest import RIG_PYTHON, SglangCluster, _plain_server

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1500)]

REFERENCE = Path(__file__).resolve().parents[2] / "backends/sglang_cpu/tokenizer_parity.py"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

PROMPTS = [
    "hello world", "Hello World!", "the quick brown fox jumps over the lazy dog",
    " leading space", "trailing space ", "  two leading", "many     inner      spaces",
    "tabs\tand\ttabs", "new\nlines\n\n\nand more", "\r\nwindows\r\n", " \t \n mixed \n\t ",
    "   ", "\n", "x", "0123456789", "3.14159 2.71828 1e-9", "!?.,:;'\"()[]{}<>/\\|-_=+*&^%$#@~`",
    "can't won't shouldn't", "URL: https://example.com/a?b=c&d=e#f", "email@example.com",
    "café naïve résumé", "日本語のテキスト", "中文测试", "한국어", "Ελληνικά", "русский текст",
    "עברית", "العربية", "emoji 🎉🚀👍🏽 family 👨‍👩‍👧", "combining e\u0301 a\u0308",
    "zero\u200bwidth", "nbsp\u00a0here", "\u0000nul\u0001ctl", "tab\x0bvt\x0cff",
    f"{BOS}", f"{BOS}after bos", f"text {EOS} more", f"{BOS}{EOS}<|pad|>",
    "<|begin_of_text|> spaced <|end_of_text|>", "<|begin_of_text", "|end_of_text|>",
    "<|user|>\nhi<|end_of_text|>\n<|assistant|>\n", "prefill decode cache token request",
    "story number one two three four five six seven eight nine ten",
    "the " * 300, "prefill decode " * 200 + "end",
    " ".join(f"word{i}" for i in range(200)),
]

SYSTEM_USER = [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "hello world"}]
TINY_CHATS = [
    {"messages": [{"role": "user", "content": "hello"}]},
    {"messages": SYSTEM_USER},
    {"messages": [*SYSTEM_USER, {"role": "assistant", "content": "hi there"},
                  {"role": "user", "content": "tell me a story"}]},
    {"messages": [{"role": "user", "content": "  spaced  \n\n out  "}]},
    {"messages": [{"role": "user", "content": "日本語 🎉 café"}]},
    {"messages": [{"role": "user", "content": f"inject {EOS}<|assistant|>\n"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                               {"type": "text", "text": "part two"}]}]},
    {"messages": [{"role": "developer", "content": "rules"}, {"role": "user", "content": "q"}]},
    {"messages": [*SYSTEM_USER, {"role": "assistant", "content": "the quick"}]},
    {"messages": [*SYSTEM_USER, {"role": "assistant", "content": "the quick"}],
     "continue_final_message": True},
    {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""}]},
    {"messages": [{"role": "user", "content": "x", "name": "ignored"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function",
                       "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "content": "result", "tool_call_id": "c1"}]},
    {"messages": SYSTEM_USER, "reasoning_effort": "low",
     "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": SYSTEM_USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"messages": [{"role": "user", "content": "the quick brown fox " * 100}]},
]

RICH_TEMPLATE = """{{- bos_token -}}
{%- if tools %}<|tools|>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}
{%- if flat_tools is defined and tools[0].function is defined %}{{ raise_exception('flat tools please') }}{% endif -%}
<|/tools|>
{% endif -%}
{%- for message in messages -%}
{%- if loop.first and message.role == 'tool' %}{{ raise_exception('a chat cannot start with a tool result') }}{% endif -%}
<|{{ message.role }}|>{% if message.name is defined %} name={{ message.name }}{% endif %}
{% if message.reasoning_content is defined and message.reasoning_content %}<think>{{ message.reasoning_content }}</think>
{% endif -%}
{%- if message.content is string %}{{ message.content }}
{%- else %}{% for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% else %}<{{ part.type }}>{% endif %}{% if not loop.last %} | {% endif %}{% endfor %}{% endif -%}
{%- if message.tool_calls is defined %}{% for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}{% endif -%}
{%- if message.tool_call_id is defined %} (for {{ message.tool_call_id }}){% endif -%}
{%- if message.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% else %}{{ eos_token }}{% endif %}
{% endfor -%}
{%- if add_generation_prompt %}<|assistant|>
{% if enable_thinking is defined and enable_thinking %}<think>
{% endif %}{% if reasoning_effort is defined %}[effort: {{ reasoning_effort }}]{% endif %}{% endif -%}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "varchar(64)"}, "days": {"type": "int32"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"parameters": {"type": "object"}, "name": "get_time",
                                         "strict": True}}
TOOL_TURNS = [
    {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "need the tool", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_1"},
]
RICH_CHATS = [
    *TINY_CHATS,
    {"messages": TOOL_TURNS, "tools": [WEATHER, TIME]},
    {"messages": [*TOOL_TURNS, {"role": "assistant", "content": "It is sunny."},
                  {"role": "user", "content": "and tomorrow?"}], "tools": [WEATHER]},
    {"messages": TOOL_TURNS, "tools": [WEATHER, TIME], "tool_choice": "none"},
    {"messages": TOOL_TURNS, "tools": [WEATHER, TIME],
     "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    {"messages": TOOL_TURNS, "tools": [WEATHER], "chat_template_kwargs": {"flat_tools": True}},
    {"messages": [{"role": "system", "content": "s", "tools": [TIME]},
                  {"role": "user", "content": "what time?"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "c"}], "name": "bot"},
                  {"role": "tool", "content": [{"type": "text", "text": "r1"},
                                               {"type": "text", "text": "r2"}],
                   "tool_call_id": "x"},
                  {"role": "user", "content": "go on"}]},
    {"messages": SYSTEM_USER, "reasoning_effort": "high"},
    {"messages": SYSTEM_USER, "chat_template_kwargs": {"enable_thinking": True,
                                                       "reasoning_effort": "medium"}},
    {"messages": SYSTEM_USER, "reasoning": {"effort": "minimal"}},
    {"messages": [*SYSTEM_USER, {"role": "assistant", "content": "Sure, the"}],
     "continue_final_message": True},
    {"messages": [{"role": "user", "content": "prefill and decode, then decode again"}]},
    {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "tool_reference", "name": "get_time"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"},
                                          {"type": "text", "text": "ok"}]},
        {"role": "function", "content": "legacy function result", "name": "get_time"},
        {"role": "user", "content": "next"}],
     "tools": [{**TIME, "defer_loading": False}, {"function": {"name": "f2"}}]},
    {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "q"},
                  {"role": "assistant", "content": "a", "tool_calls": [
                      {"id": "c9", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
                  {"role": "tool", "content": "12:00", "tool_call_id": "c9"}],
     "tools": [TIME], "reasoning_effort": 0.5},
    {"messages": [{"role": "system", "content": "s", "tools": [WEATHER]},
                  {"role": "user", "content": "q"}], "tools": [TIME],
     "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
]
REJECTED_CHATS = [
    {"messages": [{"role": "tool", "content": "r", "tool_call_id": "c"}]},  # raise_exception
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
        {"role": "user", "content": "x"}]},
    {"messages": SYSTEM_USER, "tool_choice": "required"},
    {"messages": [{"role": "User", "content": "x"}]},
    {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
    {"messages": [{"role": "assistant", "content": "only"}], "continue_final_message": True},
]


def _rich_model(base: Path, out: Path) -> Path:
    """The tiny model with a Llama-3-style tokenizer: BOS from the post-processor, declared
    PreTrainedTokenizerFast, added tokens from tokenizer_config.json, a tool-calling template."""
    shutil.copytree(base, out)
    (out / "chat_template.jinja").write_text(RICH_TEMPLATE)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": BOS, "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [vocab[BOS]], "tokens": [BOS]}}}
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", added_tokens_decoder={
        str(vocab["prefill"]): {"content": "prefill", "special": False, "normalized": True},
        str(vocab["decode"]): {"content": "decode", "special": True, "lstrip": True}})
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _variant(base: Path, out: Path, drop: tuple[str, ...] = (), padding: dict | None = None,
             **config: Any) -> Path:
    shutil.copytree(base, out)
    settings = json.loads((out / "tokenizer_config.json").read_text())
    settings.update(config)
    for key in drop:
        settings.pop(key, None)
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    if padding:
        tokenizer = json.loads((out / "tokenizer.json").read_text())
        tokenizer["padding"] = padding
        (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out


@pytest.fixture(scope="module")
def tiny(sglang_cluster: SglangCluster) -> Iterator[GatewayTokenizer]:
    """Loaded the way the gateway auto-loads it: from the path /model_info reports."""
    info = httpx.get(sglang_cluster.null_url + "/model_info", timeout=30).json()
    path = tokenizer_path_from_model_info(info)
    assert path == str(sglang_cluster.model_path)
    tok = load_tokenizer(path)
    assert tok is not None and tok.exact
    assert tok.server_info_problems(
        httpx.get(sglang_cluster.null_url + "/server_info", timeout=30).json()) == []
    yield tok
    tok.close()


@pytest.fixture(scope="module")
def rich_server(sglang_cluster: SglangCluster, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    model = _rich_model(sglang_cluster.model_path, tmp_path_factory.mktemp("rich") / "model")
    launcher = _plain_server(model, sglang_cluster.log_dir / "tokenizer-rich")
    launcher.start()
    try:
        yield next(s for s in launcher.servers if s.role == "plain").url, model
    finally:
        launcher.stop()


@pytest.fixture(scope="module")
def rich(rich_server) -> Iterator[GatewayTokenizer]:
    tok = load_tokenizer(rich_server[1])
    assert tok.exact and tok.auto_adds_specials and tok.template.content_format == "openai"
    yield tok
    tok.close()


async def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=8)
    async with httpx.AsyncClient(timeout=300, trust_env=False, limits=limits) as client:
        return await asyncio.gather(*(client.post(url, json=b) for b in bodies))


def _ok(response: httpx.Response) -> Any:
    assert response.status_code == 200, response.text[:500]
    return response.json()


ONE = {"max_new_tokens": 1, "temperature": 0}


def _check_generate(url: str, tok: GatewayTokenizer) -> int:
    bodies = [{"text": p, "sampling_params": ONE, "return_prompt_token_ids": True}
              for p in PROMPTS]
    for prompt, response in zip(PROMPTS, asyncio.run(_post_all(url + "/generate", bodies)),
                                strict=True):
        out = _ok(response)
        assert out["prompt_token_ids"] == tok.encode_text(prompt), repr(prompt)
        assert out["meta_info"]["prompt_tokens"] == len(out["prompt_token_ids"])
    batch = _ok(httpx.post(url + "/generate", timeout=300, json={
        "text": PROMPTS[:12], "sampling_params": ONE, "return_prompt_token_ids": True}))
    assert [b["prompt_token_ids"] for b in batch] == tok.encode_generate({"text": PROMPTS[:12]})
    return len(PROMPTS) + 12


def _check_completions(url: str, tok: GatewayTokenizer, model: str) -> int:
    shapes = [*PROMPTS[:20], PROMPTS[20:30], [5, 6, 7, 8], [[9, 10], [11, 12, 13]]]
    bodies = [{"model": model, "prompt": p, "max_tokens": 1, "temperature": 0,
               "return_token_ids": True} for p in shapes]
    compared = 0
    for prompt, response in zip(shapes, asyncio.run(_post_all(url + "/v1/completions", bodies)),
                                strict=True):
        choices = sorted(_ok(response)["choices"], key=lambda c: c["index"])
        expected = tok.encode_prompt(prompt)
        assert [c["prompt_token_ids"] for c in choices] == expected, repr(prompt)
        compared += len(expected)
    return compared


def _check_chats(url: str, tok: GatewayTokenizer, model: str, chats: list[dict]) -> int:
    bodies = [{**c, "model": model, "max_tokens": 1, "temperature": 0,
               "return_prompt_token_ids": True} for c in chats]
    responses = asyncio.run(_post_all(url + "/v1/chat/completions", bodies))
    for body, response in zip(bodies, responses, strict=True):
        out = _ok(response)
        ids = tok.encode_chat(body)
        assert out["choices"][0]["prompt_token_ids"] == ids, json.dumps(body)[:300]
        assert out["usage"]["prompt_tokens"] == len(ids)
    return len(chats)


def test_text_prompts_on_the_tiny_model(sglang_cluster: SglangCluster, tiny) -> None:
    assert _check_generate(sglang_cluster.null_url, tiny) > 50


def test_completion_prompts_on_the_tiny_model(sglang_cluster: SglangCluster, tiny) -> None:
    assert _check_completions(sglang_cluster.null_url, tiny, sglang_cluster.model_name) > 30


def test_chats_on_the_tiny_model(sglang_cluster: SglangCluster, tiny) -> None:
    assert _check_chats(sglang_cluster.null_url, tiny, sglang_cluster.model_name,
                        TINY_CHATS) == len(TINY_CHATS)


def test_text_and_completion_prompts_with_a_bos_post_processor(rich_server, rich) -> None:
    url = rich_server[0]
    assert rich.encode_text("hello")[0] == rich.bos_token_id
    _check_generate(url, rich)
    _check_completions(url, rich, "tiny-llama")


def test_tool_calling_chats_on_the_variant_model(rich_server, rich) -> None:
    url = rich_server[0]
    assert _check_chats(url, rich, "tiny-llama", RICH_CHATS) == len(RICH_CHATS)


def test_what_sglang_refuses_gets_no_ids(rich_server, rich) -> None:
    bodies = [{**c, "model": "tiny-llama", "max_tokens": 1} for c in REJECTED_CHATS]
    for body, response in zip(bodies, asyncio.run(
            _post_all(rich_server[0] + "/v1/chat/completions", bodies)), strict=True):
        # 400, or 500 for a chat_template_kwargs key that clashes with SGLang's own arguments
        assert response.status_code in (400, 500), response.text[:300]
        with pytest.raises(RejectedRequest):
            rich.encode_chat(body)


def test_tokenizer_file_variants_against_sglang_get_tokenizer(sglang_cluster, tmp_path) -> None:
    """Without a server: the ids SGLang's get_tokenizer (with its transformers 5 fixes) gives
    for tokenizer_config.json variants, next to the gateway's."""
    base = sglang_cluster.model_path
    vocab = json.loads((base / "tokenizer.json").read_text())["model"]["vocab"]
    variants = {
        "llama class (BOS added)": _variant(base, tmp_path / "llama",
                                            tokenizer_class="LlamaTokenizerFast"),
        "llama class, add_bos_token false": _variant(
            base, tmp_path / "nobos", tokenizer_class="LlamaTokenizerFast", add_bos_token=False),
        "split_special_tokens": _variant(base, tmp_path / "split", split_special_tokens=True),
        "added and extra special tokens": _variant(
            base, tmp_path / "added", additional_special_tokens=["<|im_start|>", "<|im_end|>"],
            image_token="<image>", added_tokens_decoder={
                "512": {"content": "<tool_call>", "special": True},
                "513": {"content": " story teller", "lstrip": True, "rstrip": True,
                        "single_word": True, "normalized": True, "special": False},
                str(vocab["prefill"]): {"content": "prefill", "special": False}}),
        "pad token from tokenizer.json padding": _variant(
            base, tmp_path / "padding", drop=("pad_token",), padding={
                "strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}),
    }
    (base_legacy := _variant(base, tmp_path / "legacy")).joinpath(
        "special_tokens_map.json").write_text(json.dumps(
            {"bos_token": {"content": BOS, "lstrip": False, "normalized": False,
                           "rstrip": False, "single_word": False},
             "additional_special_tokens": ["<extra_0>"]}))
    variants["legacy special_tokens_map.json"] = base_legacy
    texts = [*PROMPTS, "a <tool_call>x the story teller story tellers prefill", "<image> <unk> <pad>",
             "<|im_start|>user\nhi<|im_end|>", "<extra_0> tell me a story teller"]
    request = json.dumps({"paths": [str(p) for p in variants.values()], "texts": texts})
    run = subprocess.run([str(RIG_PYTHON), str(REFERENCE), "--json"], capture_output=True,
                         text=True, input=request, timeout=600, check=True)
    reference = json.loads(run.stdout)
    for name, path in variants.items():
        tok = load_tokenizer(path)
        for text, expected in zip(texts, reference[str(path)]["ids"], strict=True):
            assert tok.encode_text(text) == expected, (name, text)
        tok.close()
    assert reference[str(variants["llama class (BOS added)"])]["class"] == "LlamaTokenizer"
