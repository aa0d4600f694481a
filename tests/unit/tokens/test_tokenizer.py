"""gateway/tokens/tokenizer.py with a tokenizer built here (the CPU rig's recipe: a byte-level BPE
trained in memory) and chat templates written here. Equality with real SGLang is proven in
tests/e2e_sglang/test_tokenizer.py; these tests pin the rendering rules and the API."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from tokenizers import Tokenizer

from backends.tiny_tokenizer import BOS, EOS, PLAIN, train, write_model
from gateway.config.settings import ConfigError, load_config
from gateway.tokens.chat_template import ChatTemplate
from gateway.tokens.tokenizer import (
    INLINE_CHARS,
    RejectedRequest,
    TokenizerLoadError,
    UnsupportedRequest,
    load_tokenizer,
    tokenizer_path_from_model_info,
)

# A template in the style of tool-calling models: tools, tool calls, content parts, kwargs.
RICH = """{{- bos_token }}
{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
{% endif %}
{%- for message in messages %}
<|{{ message.role }}|>
{%- if message.content is string %}{{ message.content }}
{%- else %}{% for part in message.content %}[{{ part.type }}:{{ part.text }}]{% endfor %}
{%- endif %}
{%- if message.tool_calls %}{% for call in message.tool_calls %}<call>{{ call.function.name }}
{{- call.function.arguments | tojson }}</call>{% endfor %}{% endif %}
{%- if message.name is defined %}(name={{ message.name }}){% endif %}
{{- eos_token }}
{%- endfor %}
{%- if enable_thinking is defined %}<think={{ enable_thinking }}>{% endif %}
{%- if reasoning_effort is defined %}<effort={{ reasoning_effort }}>{% endif %}
{%- if custom is defined %}<custom={{ custom }}>{% endif %}
{%- if add_generation_prompt %}
<|assistant|>
{% endif %}"""


@pytest.fixture(scope="module")
def trained() -> Tokenizer:
    return train()


@pytest.fixture
def plain(tmp_path, trained):
    tok = load_tokenizer(write_model(tmp_path / "plain", trained))
    yield tok
    tok.close()


@pytest.fixture
def rich(tmp_path, trained):
    tok = load_tokenizer(write_model(tmp_path / "rich", trained, RICH))
    yield tok
    tok.close()


def chat(*messages, **body):
    return {"messages": [{"role": r, "content": c} for r, c in messages], **body}


# ---- loading ----

def test_load_directory_file_and_missing(tmp_path, trained):
    directory = write_model(tmp_path / "m", trained)
    from_dir = load_tokenizer(directory)
    from_file = load_tokenizer(directory / "tokenizer.json")
    assert from_dir.encode_text("hello world") == from_file.encode_text("hello world")
    assert from_file.template is not None  # siblings are read
    assert load_tokenizer(tmp_path / "nothing") is None
    assert load_tokenizer(None) is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError):
        load_tokenizer(tmp_path / "bad")
    assert "exact" in from_dir.describe() and "'default'" in from_dir.describe()


def test_template_sources_and_priority(tmp_path, trained):
    directory = write_model(tmp_path / "m", trained, template="from config")
    assert load_tokenizer(directory).template.source == "from config"
    (directory / "chat_template.jinja").write_text("from jinja file")
    assert load_tokenizer(directory).template.source == "from jinja file"
    extra = directory / "additional_chat_templates"
    extra.mkdir()
    (extra / "tool_use.jinja").write_text("tool template")
    assert load_tokenizer(directory).template.name == "default"  # SGLang: the first
    assert load_tokenizer(directory, chat_template_name="tool_use").template.source == (
        "tool template")
    with pytest.raises(TokenizerLoadError):
        load_tokenizer(directory, chat_template_name="nope")
    listed = write_model(tmp_path / "l", trained, template=[
        {"name": "a", "template": "A"}, {"name": "b", "template": "B"}])
    assert load_tokenizer(listed).template.source == "A"
    legacy = write_model(tmp_path / "j", trained, template=None)
    assert load_tokenizer(legacy).template is None
    (legacy / "chat_template.json").write_text(json.dumps({"chat_template": "legacy"}))
    assert load_tokenizer(legacy).template.source == "legacy"


def test_no_template_means_no_chat_ids(tmp_path, trained):
    tok = load_tokenizer(write_model(tmp_path / "m", trained, template=None))
    assert tok.encode_text("hi")
    with pytest.raises(UnsupportedRequest):
        tok.encode_chat(chat(("user", "hi")))


def test_config_tokens_split_and_bos_rules(tmp_path, trained):
    added = load_tokenizer(write_model(
        tmp_path / "a", trained, additional_special_tokens=["<tool_call>"],
        added_tokens_decoder={"400": {"content": "<extra>", "special": True}}))
    assert len(added.encode_text("x<tool_call>y<extra>")) == 4
    split = load_tokenizer(write_model(tmp_path / "s", trained, split_special_tokens=True))
    assert len(split.encode_text(BOS)) > 1
    llama = load_tokenizer(write_model(tmp_path / "l", trained,
                                       tokenizer_class="LlamaTokenizerFast"))
    assert llama.encode_text("hello")[0] == 0 and llama.auto_adds_specials
    assert not llama.exact and "approximate" in llama.describe()
    no_bos = load_tokenizer(write_model(tmp_path / "n", trained,
                                        tokenizer_class="LlamaTokenizerFast",
                                        add_bos_token=False))
    assert no_bos.encode_text("hello")[0] != 0


# ---- text prompts ----

@pytest.mark.parametrize("text", ["hello world", "  spaces  and\ttabs\n\n", "日本語 🎉",
                                  f"{BOS}hi{EOS}", "the quick brown fox " * 40])
def test_encode_text_is_encode_with_special_tokens(plain, trained, text):
    assert plain.encode_text(text) == trained.encode(text, add_special_tokens=True).ids


def test_prompt_shapes(tmp_path, trained):
    tok = load_tokenizer(write_model(tmp_path / "b", trained, bos_post_processor=True))
    assert tok.encode_text("hello")[0] == 0
    assert tok.encode_prompt("hello") == [tok.encode_text("hello")]
    assert tok.encode_prompt(["hello", "dog"]) == [tok.encode_text("hello"),
                                                   tok.encode_text("dog")]
    assert tok.encode_prompt([5, 6, 7]) == [[5, 6, 7]]
    assert tok.encode_prompt([[5, 6], [7]]) == [[5, 6], [7]]
    assert tok.encode_generate({"text": "hello"}) == [tok.encode_text("hello")]
    assert tok.encode_generate({"text": ["a", "b"]}) == tok.encode_texts(["a", "b"])
    assert tok.encode_generate({"text": "x", "input_ids": [1, 2]}) == [[1, 2]]
    for bad in ("", [], ["", ""], [1, "a"], {"x": 1}):
        with pytest.raises(RejectedRequest):
            tok.encode_prompt(bad)
    with pytest.raises(UnsupportedRequest):
        tok.encode_generate({"text": "x", "image_data": "http://img"})
    with pytest.raises(UnsupportedRequest):  # MAX_CHARS: no ids rather than seconds of CPU
        tok.encode_prompt(["a" * 3_000_000, "b" * 3_000_000])


# ---- chat rendering ----

def test_system_user_assistant_turns(plain):
    text, prefix = plain.render_chat(chat(("system", "be brief"), ("user", "hi"),
                                          ("assistant", "hello"), ("user", "tell me")))
    assert prefix is None
    assert text == (f"{BOS}<|system|>\nbe brief{EOS}\n<|user|>\nhi{EOS}\n"
                    f"<|assistant|>\nhello{EOS}\n<|user|>\ntell me{EOS}\n<|assistant|>\n")
    ids = plain.encode_chat(chat(("user", "hi")))
    assert ids[0] == 0 and ids.count(0) == 1  # the template's BOS, not a second one


def test_last_assistant_message_and_continue_final_message(plain, tmp_path, trained):
    body = chat(("user", "hi"), ("assistant", "the quick"))
    text, _ = plain.render_chat(body)  # SGLang turns a last assistant message into a user one
    assert text.endswith(f"<|user|>\nthe quick{EOS}\n<|assistant|>\n")
    text, prefix = plain.render_chat({**body, "continue_final_message": True})
    assert prefix == "the quick" and text.endswith(f"<|user|>\nhi{EOS}\n<|assistant|>\n")
    ids = plain.encode_chat({**body, "continue_final_message": True})
    assert ids == plain.backend.encode(text, add_special_tokens=False).ids + \
        plain.encode_text("the quick")
    bos = load_tokenizer(write_model(tmp_path / "b", trained, bos_post_processor=True))
    ids = bos.encode_chat({**body, "continue_final_message": True})
    assert ids.count(0) == 1  # the prefix's BOS is dropped, and specials are not re-added
    # add_generation_prompt is not a chat-completions field in SGLang: ignored
    assert plain.render_chat({**body, "add_generation_prompt": False})[0] == (
        plain.render_chat(body)[0])


def test_add_generation_prompt_false_in_the_renderer():
    template = ChatTemplate(PLAIN, {"bos_token": BOS, "eos_token": EOS})
    text = template.render([{"role": "user", "content": "hi"}], None, {},
                           add_generation_prompt=False)
    assert text == f"{BOS}<|user|>\nhi{EOS}\n"


def test_content_parts_string_and_openai_formats(plain, rich):
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    body = {"messages": [{"role": "user", "content": parts}]}
    assert plain.template.content_format == "string"
    assert "<|user|>\none two" in plain.render_chat(body)[0]  # joined with a space
    assert rich.template.content_format == "openai"
    assert "<|user|>[text:one][text:two]" in rich.render_chat(body)[0]
    tool = {"messages": [{"role": "user", "content": "q"},
                         {"role": "tool", "content": parts, "tool_call_id": "c1"}]}
    assert "<|tool|>one two" in rich.render_chat(tool)[0]  # tool text parts are flattened
    with pytest.raises(UnsupportedRequest):
        rich.encode_chat({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]})


def test_unknown_fields_dropped_and_known_ones_kept(rich):
    text, _ = rich.render_chat({"messages": [
        {"role": "user", "content": "q", "name": "bob"},  # not a user field in SGLang
        {"role": "assistant", "content": "a", "name": "bot", "extra": 1},
        {"role": "user", "content": "r"}]})
    assert "(name=bob)" not in text and "(name=bot)" in text


def test_tools_and_tool_calls(rich):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "varchar(64)"}}}}}]
    body = {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "user", "content": "thanks"}], "tools": tools}
    text, _ = rich.render_chat(body)
    # Function._serialize: the client's keys first, then the fields it left out; the DB-style
    # type is normalized; the tool's own defer_loading stays (null)
    assert ('<tools>{"type": "function", "function": {"name": "get_weather", "parameters": '
            '{"type": "object", "properties": {"city": {"type": "string"}}}, '
            '"description": null}, "defer_loading": null}</tools>') in text
    assert '<|assistant|><call>get_weather{"city": "Paris"}</call>' in text  # parsed JSON
    assert "<tools>" not in rich.render_chat({**body, "tool_choice": "none"})[0]
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    assert "<tools>" in rich.render_chat(named)[0]
    with pytest.raises(RejectedRequest):
        rich.render_chat({**body, "tool_choice": {"type": "function",
                                                  "function": {"name": "other"}}})
    with pytest.raises(RejectedRequest):
        rich.render_chat(chat(("user", "x"), tool_choice="required"))
    bad_args = json.loads(json.dumps(body))
    bad_args["messages"][1]["tool_calls"][0]["function"]["arguments"] = "not json"
    with pytest.raises(RejectedRequest):
        rich.render_chat(bad_args)


def test_tools_are_flattened_when_the_template_refuses_the_wrapper(tmp_path, trained):
    template = ("{% for tool in tools %}{% if tool.function is defined %}"
                "{{ raise_exception('flat tools only') }}{% endif %}[{{ tool.name }}]"
                "{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}")
    tok = load_tokenizer(write_model(tmp_path / "f", trained, template))
    body = chat(("user", "hi"), tools=[{"type": "function", "function": {"name": "f"}}])
    assert tok.render_chat(body)[0] == "[f]hi"


def test_chat_template_kwargs_and_reasoning_effort(rich):
    text, _ = rich.render_chat(chat(("user", "x"), chat_template_kwargs={"custom": 7}))
    assert "<custom=7>" in text and "<think=" not in text
    text, _ = rich.render_chat(chat(("user", "x"), reasoning_effort="low"))
    assert "<think=True><effort=low>" in text  # protocol.py normalize_reasoning_inputs
    text, _ = rich.render_chat(chat(("user", "x"), reasoning_effort="none",
                                    chat_template_kwargs={"enable_thinking": True}))
    assert "<think=True><effort=none>" in text
    text, _ = rich.render_chat(chat(("user", "x"),
                                    chat_template_kwargs={"reasoning_effort": "high"}))
    assert "<effort=high>" in text and "<think=" not in text
    with pytest.raises(UnsupportedRequest):
        rich.render_chat(chat(("user", "x"), chat_template_kwargs={"chat_template": "x"}))
    with pytest.raises(RejectedRequest):
        rich.render_chat(chat(("user", "x"), chat_template_kwargs={"tools": []}))


def test_template_globals_and_errors(tmp_path, trained):
    template = ("{% generation %}{{ strftime_now('%Y') }}{% endgeneration %}"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                "{{ m.content }}{% endfor %}"
                "{% if messages[-1].content == 'boom' %}{{ raise_exception('no boom') }}"
                "{% endif %}{{ {'a': '<&>'} | tojson }}")
    tok = load_tokenizer(write_model(tmp_path / "g", trained, template))
    text, _ = tok.render_chat(chat(("user", "one"), ("user", "two")))
    assert text[4:] == 'one{"a": "<&>"}' and text[:4].isdigit()
    with pytest.raises(RejectedRequest, match="no boom"):
        tok.encode_chat(chat(("user", "boom")))
    for body in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                 {"messages": [{"role": "user"}]}, "not a dict"):
        with pytest.raises(RejectedRequest):
            tok.encode_chat(body)
    assert tok.encode_chat({"messages": [], "input_ids": [3, 4]}) == [3, 4]
    with pytest.raises(TokenizerLoadError):
        load_tokenizer(write_model(tmp_path / "x", trained, "{% for %}"))


# ---- async variants and the pool ----

def test_async_variants_give_the_same_ids(rich):
    long_text = "the quick brown fox " * (INLINE_CHARS // 10)
    body = chat(("system", "s"), ("user", long_text))

    async def run():
        return await asyncio.gather(
            rich.aencode_prompt("short"), rich.aencode_prompt(long_text),
            rich.aencode_prompt(["a", long_text]), rich.aencode_generate({"text": long_text}),
            rich.aencode_chat(body), *[rich.aencode_chat(body) for _ in range(8)])

    results = asyncio.run(run())
    assert results[0] == rich.encode_prompt("short")
    assert results[1] == rich.encode_prompt(long_text)
    assert results[2] == rich.encode_prompt(["a", long_text])
    assert results[3] == rich.encode_generate({"text": long_text})
    assert all(r == rich.encode_chat(body) for r in results[4:])


def test_long_work_runs_in_the_pool(rich, monkeypatch):
    seen = []
    real = rich.encode_text
    monkeypatch.setattr(rich, "encode_text",
                        lambda t: seen.append(threading.current_thread().name) or real(t))
    asyncio.run(rich.aencode_prompt("x" * (INLINE_CHARS + 1)))
    asyncio.run(rich.aencode_prompt("x"))
    assert seen[0].startswith("tokenizer") and seen[1] == threading.current_thread().name


def test_short_chats_are_encoded_inline_long_ones_in_the_pool(rich, monkeypatch):
    seen = []
    real = rich.encode_chat
    monkeypatch.setattr(rich, "encode_chat",
                        lambda b: seen.append(threading.current_thread().name) or real(b))
    short = asyncio.run(rich.aencode_chat(chat(("user", "hello"))))
    asyncio.run(rich.aencode_chat(chat(("user", "x" * (INLINE_CHARS + 1)))))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    asyncio.run(rich.aencode_chat(chat(("user", "hi"), tools=[tool])))
    assert seen[0] == threading.current_thread().name
    assert seen[1].startswith("tokenizer") and seen[2].startswith("tokenizer")
    assert short == rich.encode_chat(chat(("user", "hello")))


# ---- helpers and config ----

def test_tokenizer_path_from_model_info(tmp_path, trained):
    directory = write_model(tmp_path / "m", trained)
    assert tokenizer_path_from_model_info({"tokenizer_path": str(directory)}) == str(directory)
    assert tokenizer_path_from_model_info(
        {"tokenizer_path": "/not/here", "model_path": str(directory)}) == str(directory)
    assert tokenizer_path_from_model_info({"tokenizer_path": "org/remote-model"}) is None
    assert tokenizer_path_from_model_info({}) is None


def test_server_info_problems(plain):
    assert plain.server_info_problems({"chat_template": None, "reasoning_parser": None}) == []
    problems = plain.server_info_problems({"chat_template": "x.jinja",
                                           "hf_chat_template_name": "tool_use",
                                           "tokenizer_mode": "slow"})
    assert len(problems) == 3


def test_config_tokenizer_setting(tmp_path, trained):
    directory = write_model(tmp_path / "m", trained)
    base = ["--prefill", "http://p:1", "--decode", "http://d:2"]
    cfg = load_config(base + ["--tokenizer", str(directory)], environ={})
    assert cfg.tokenizer == str(directory) and cfg.tokenizer_threads == 2
    assert load_config(base, environ={}).tokenizer is None
    with pytest.raises(ConfigError, match="tokenizer"):
        load_config(base + ["--tokenizer", str(tmp_path / "nope")], environ={})
    with pytest.raises(ConfigError, match="tokenizer_threads"):
        load_config(base + ["--tokenizer-threads", "0"], environ={})
