"""The served model's tokenizer in the gateway: the token ids SGLang 0.5.23 computes for each
request shape, from the model's own files, with the kept `tokenizers` and `jinja2` libraries.

Use: `tok = load_tokenizer(cfg.tokenizer or tokenizer_path_from_model_info(info),
threads=cfg.tokenizer_threads)`; None means "no tokenizer": everything works without ids. Then,
only where a policy or a check needs ids: `await tok.aencode_chat(body)` (/v1/chat/completions),
`await tok.aencode_prompt(body["prompt"])` (/v1/completions), `await tok.aencode_generate(body)`
(native /generate). A `TokenizerError` (UnsupportedRequest, RejectedRequest) means "no ids for
this request": forward it as usual, SGLang gives its own answer.

SGLang's rules mirrored (sources under `sglang/srt/`):
* text (native /generate `text`, completions string prompts): `TokenizerManager._tokenize_texts`
  calls `tokenizer(texts)`, i.e. `encode(text, add_special_tokens=True)`; token-id prompts
  (`input_ids`, completions lists of ints) pass through untouched.
* the tokenizer: `utils/hf_transformers/tokenizer.py get_tokenizer`, which for tokenizer.json
  models is transformers 5's `TokenizersBackend`: tokenizer.json as it is, no truncation or
  padding, `split_special_tokens`, tokenizer_config.json's added and special tokens added the
  way `TokenizersBackend.__init__` adds them, and SGLang's `_fix_v5_add_bos_eos_token` (BOS
  template for Llama/Gemma/Cohere classes). Declared classes that transformers 5 rebuilds
  from vocab and merges (LlamaTokenizer, Qwen2Tokenizer, GemmaTokenizer, ...) may tokenize
  differently from tokenizer.json: `exact` is False for them and `describe()` says so.
* chat: `serving_chat.py _apply_jinja_template` (gateway/tokens/messages.py, gateway/tokens/chat_template.py)
  renders the template to text, then `encode(text, add_special_tokens=False)` when
  `encode("")` is not empty (`_tokenizer_auto_adds_specials`), plain `encode(text)` otherwise;
  `continue_final_message` appends `encode(prefix)` minus a leading BOS
  (`_append_assistant_prefix_to_prompt_ids`).

Threads: `tokenizers` releases the GIL in `encode_batch` (not in `encode`), so long prompts are
encoded with it in a small `ThreadPoolExecutor` and the event loop keeps serving (SGLang itself
encodes through `encode_batch`: transformers' `_encode_plus`). Measured with loadtests/tokenizer_cost.py
on the CPU rig (2 shared cores, tiny model; medians): a pool hop costs 40-150 us; encoding
takes ~0.2 us per character (~1.5 us per token): 128 chars 26 us, 512 chars ~100-160 us,
2048 chars ~400 us, 8k tokens 12-18 ms. So texts up to `INLINE_CHARS` (512, ~100 tokens) are
encoded inline, where the hop would cost as much as the work; longer ones go to the pool: 50
concurrent 8k-token requests stalled the loop 450-900 ms inline, 50-150 ms via the pool. Chat
rendering is Python (holds the GIL) but cheap (20-40 us; 70 us with 4 tools and 4 turns): a
short chat (messages up to `INLINE_CHARS` of text, no tools) is rendered and encoded inline,
a longer one goes to the pool with its encode. No cache: a hit would save the encode, but whole prompts
rarely repeat exactly, and a key costs a hash of the whole prompt.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from gateway.tokens.chat_template import (
    ChatTemplate,
    RejectedRequest,
    TokenizerError,
    TokenizerLoadError,
    UnsupportedRequest,
    find_chat_templates,
    select_chat_template,
)
from gateway.tokens.files import read_tokenizer_files
from gateway.tokens.messages import prepare_chat

__all__ = ["GatewayTokenizer", "RejectedRequest", "TokenizerError", "TokenizerLoadError",
           "UnsupportedRequest", "load_tokenizer", "tokenizer_path_from_model_info"]

INLINE_CHARS = 512  # texts up to this many characters are encoded on the event loop
MAX_CHARS = 4 << 20  # longer prompts are not tokenized (~1 s of a pool thread; no ids)
# Declared classes that transformers 5 loads as tokenizer.json itself (TokenizersBackend).
_JSON_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# serving_chat / chat_encoding.py / python_chat_template.py: models whose chats SGLang encodes
# with its own code instead of the Jinja template.
_CUSTOM_CHAT_ARCHS = ("DeepseekV4", "DeepseekV41", "KimiK3", "InklingForConditionalGeneration",
                      "GlmMoeDsaForCausalLM", "Glm5NextForConditionalGeneration")
_MULTIMODAL_KEYS = ("vision_config", "audio_config", "visual", "vision_tower", "mm_vision_tower")


class GatewayTokenizer:
    """Token ids as SGLang computes them. Thread-safe because the backend is never changed
    after load: a setter (truncation, padding...) while another thread is in `encode_batch`
    fails with "Already borrowed" (transformers#47085)."""

    def __init__(self, backend: Tokenizer, config: dict, model_config: dict, source: str,
                 template: ChatTemplate | None, specials: dict[str, str], threads: int = 2):
        self.backend = backend
        self.source = source
        self.template = template
        self.tokenizer_class = config.get("tokenizer_class")
        self.exact = self.tokenizer_class in _JSON_CLASSES and "auto_map" not in config
        bos = specials.get("bos_token")
        self.bos_token_id = backend.token_to_id(bos) if bos else None
        self.auto_adds_specials = len(backend.encode("", add_special_tokens=True).ids) > 0
        archs = model_config.get("architectures") or [""]
        self._chat_problem = None
        if any(name in str(archs[0]) for name in _CUSTOM_CHAT_ARCHS) or model_config.get(
                "model_type") == "minimax_m3_vl":
            self._chat_problem = f"SGLang encodes {archs[0]} chats with its own encoder"
        elif "DeepseekV3" in str(archs[0]) and template is None:
            self._chat_problem = "SGLang encodes this DeepSeek-V3 chat with its dsv32 encoder"
        elif any(key in model_config for key in _MULTIMODAL_KEYS):
            self._chat_problem = "multimodal models render chats through their processor"
        elif template is None:
            self._chat_problem = "the model has no chat template"
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads),
                                        thread_name_prefix="tokenizer")

    # ---- synchronous API (runs wherever it is called) ----

    def encode_text(self, text: str) -> list[int]:
        """A text prompt: native /generate `text`, a completions string prompt."""
        if not isinstance(text, str):
            raise RejectedRequest("a text prompt must be a string")
        return self._encode(text, True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) > MAX_CHARS:
            raise UnsupportedRequest(f"a prompt of {len(text)} characters is not tokenized")
        if len(text) <= INLINE_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # the same ids; unlike encode(), encode_batch() releases the GIL while it works
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        if not all(isinstance(t, str) for t in texts):
            raise RejectedRequest("text prompts must be strings")
        if sum(map(len, texts)) > MAX_CHARS:
            raise UnsupportedRequest("prompts this long are not tokenized")
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=True)]

    def encode_prompt(self, prompt: Any) -> list[list[int]]:
        """/v1/completions `prompt` (str, [str], [int], [[int]]): the ids of each prompt."""
        if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
            raise RejectedRequest("Prompt cannot be empty")
        if isinstance(prompt, str):
            return [self.encode_text(prompt)]
        if not isinstance(prompt, list):
            raise RejectedRequest("prompt must be a string, a list of strings or token ids")
        if isinstance(prompt[0], str):
            return self.encode_texts(prompt)
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
        raise RejectedRequest("prompt must be a string, a list of strings or token ids")

    def encode_generate(self, body: dict) -> list[list[int]]:
        """Native /generate: `input_ids` as given, else `text` (a string or a batch)."""
        if not isinstance(body, dict):
            raise RejectedRequest("the body is not a JSON object")
        for key in ("input_embeds", "image_data", "video_data", "audio_data"):
            if body.get(key) is not None:
                raise UnsupportedRequest(f"/generate with {key}")
        ids = body.get("input_ids")
        if ids is not None:
            if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
                return [list(ids)]
            if isinstance(ids, list) and ids and all(
                    isinstance(p, list) and all(_is_int(t) for t in p) for p in ids):
                return [list(p) for p in ids]
            raise RejectedRequest("input_ids must be a list of ints or of lists of ints")
        text = body.get("text")
        if isinstance(text, str):
            return [self.encode_text(text)]
        if isinstance(text, list) and text:
            return self.encode_texts(text)
        raise RejectedRequest("Either text, input_ids or input_embeds should be provided.")

    def render_chat(self, body: dict) -> tuple[str, str | None]:
        """The rendered chat template and the continue_final_message prefix (for tests)."""
        if self._chat_problem:
            raise UnsupportedRequest(self._chat_problem)
        prepared = prepare_chat(body, self.template.content_format)
        try:
            text = self.template.render(prepared.messages, prepared.tools, prepared.kwargs)
        except RejectedRequest:
            if not prepared.tools:
                raise
            flat = [t["function"] if "function" in t else t for t in prepared.tools]
            text = self.template.render(prepared.messages, flat, prepared.kwargs)
        return text, prepared.assistant_prefix

    def encode_chat(self, body: dict) -> list[int]:
        """/v1/chat/completions: the prompt ids SGLang builds from the messages."""
        if isinstance(body, dict) and body.get("input_ids") is not None:
            ids = body["input_ids"]
            if isinstance(ids, list) and all(_is_int(t) for t in ids):
                return list(ids)
            raise RejectedRequest("input_ids must be a list of ints")
        text, prefix = self.render_chat(body)
        ids = self._encode(text, not self.auto_adds_specials)
        if prefix:
            tail = self._encode(prefix, True)
            if tail and tail[0] == self.bos_token_id:
                tail = tail[1:]
            ids = ids + tail
        return ids

    # ---- async API: never blocks the event loop for long ----

    async def aencode_prompt(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str) and len(prompt) <= INLINE_CHARS:
            return self.encode_prompt(prompt)
        return await self._run(self.encode_prompt, prompt)

    async def aencode_generate(self, body: dict) -> list[list[int]]:
        if not isinstance(body, dict):
            return self.encode_generate(body)
        text = body.get("text")
        if body.get("input_ids") is not None or (
                isinstance(text, str) and len(text) <= INLINE_CHARS):
            return self.encode_generate(body)
        return await self._run(self.encode_generate, body)

    async def aencode_chat(self, body: dict) -> list[int]:
        """Short chats inline (the pool hop would cost more than rendering and encoding
        them), longer ones in the pool."""
        if _chat_chars(body) <= INLINE_CHARS:
            return self.encode_chat(body)
        return await self._run(self.encode_chat, body)

    async def _run(self, fn: Any, arg: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, arg)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- reporting ----

    def describe(self) -> str:
        """One line for the startup log."""
        vocab = self.backend.get_vocab_size(with_added_tokens=True)
        chat = (f"chat template {self.template.name!r} ({self.template.content_format} content)"
                if self.template else "no chat template")
        if self._chat_problem and self.template:
            chat += f", chats not tokenized: {self._chat_problem}"
        kind = ("exact" if self.exact else
                f"approximate: SGLang loads tokenizer_class {self.tokenizer_class!r} through "
                "transformers, which may rebuild it; verify with backends/sglang_cpu/tokenizer_parity.py")
        return (f"tokenizer {self.source}: {vocab} tokens, {kind}; {chat}; "
                f"specials {'added' if self.auto_adds_specials else 'not added'} to text prompts")

    def server_info_problems(self, info: dict) -> list[str]:
        """Server settings (GET /server_info) under which SGLang's ids differ from ours."""
        problems = []
        for key in ("chat_template", "completion_template", "default_chat_template_kwargs"):
            if info.get(key):
                problems.append(f"the server runs with --{key.replace('_', '-')}")
        name = info.get("hf_chat_template_name")
        if name and (self.template is None or self.template.name != name):
            problems.append(f"the server uses chat template {name!r}")
        if info.get("skip_tokenizer_init"):
            problems.append("the server skips tokenizer init (token-id prompts only)")
        if info.get("tokenizer_mode") == "slow":
            problems.append("the server uses the slow tokenizer")
        if info.get("reasoning_parser"):
            problems.append("a reasoning parser can change continue_final_message prompts")
        if info.get("tool_call_parser") in ("deepseekv32", "deepseekv4", "deepseekv41",
                                            "kimi_k3", "muse"):
            problems.append(f"tool-call parser {info['tool_call_parser']} has its own encoder")
        return problems


def _chat_chars(body: dict) -> int:
    """About how much text a chat renders (its messages' text; tools count as a lot)."""
    if not isinstance(body, dict) or body.get("tools"):
        return MAX_CHARS
    messages = body.get("messages")
    if not isinstance(messages, list):
        return MAX_CHARS
    size = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            size += len(content)
        elif content is not None:
            size += INLINE_CHARS  # parts: let the pool have it
    return size


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_tokenizer(path: str | os.PathLike | None, *, threads: int = 2,
                   chat_template_name: str | None = None) -> GatewayTokenizer | None:
    """A model directory (tokenizer.json, tokenizer_config.json, chat_template.jinja ...) or a
    tokenizer.json file (its siblings are read too). None when there is no tokenizer.json;
    TokenizerLoadError when the files are there but unusable."""
    if not path:
        return None
    files = read_tokenizer_files(Path(path))
    if files is None:
        return None
    chosen = select_chat_template(find_chat_templates(files.directory, files.config),
                                  chat_template_name)
    template = ChatTemplate(chosen[1], files.specials, chosen[0]) if chosen else None
    return GatewayTokenizer(files.backend, files.config, files.model_config,
                            str(files.directory), template, files.specials, threads)


def tokenizer_path_from_model_info(info: dict) -> str | None:
    """The tokenizer directory the servers report in GET /model_info (`tokenizer_path`, else
    `model_path`), when it holds a tokenizer.json readable here; else None."""
    for key in ("tokenizer_path", "model_path"):
        value = info.get(key) if isinstance(info, dict) else None
        if isinstance(value, str) and value:
            candidate = Path(value)
            if (candidate / "tokenizer.json").is_file() or (
                    candidate.name == "tokenizer.json" and candidate.is_file()):
                return value
    return None
