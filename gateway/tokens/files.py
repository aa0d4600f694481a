"""Reading a model's tokenizer files the way SGLang 0.5.23 loads them (transformers 5's
`TokenizersBackend.from_pretrained`, then SGLang's `get_tokenizer` post-load fixes), into a
`tokenizers.Tokenizer` and the named special tokens a chat template sees.

Mirrored: tokenizer.json as it is, without truncation or padding (`set_truncation_and_padding`
turns them off for every call); `split_special_tokens`; tokenizer_config.json's
`added_tokens_decoder`, named special tokens (`bos_token` ... `mask_token`, then model-specific
`*_token` keys and an `extra_special_tokens` dict) and extra special tokens, added as
`TokenizersBackend.__init__` adds them (special_tokens_map.json when the config has no
`added_tokens_decoder`, as `_from_pretrained` does); SGLang's `_fix_v5_add_bos_eos_token`
(BOS post-processor for Llama/Gemma/Cohere classes, add_bos_token defaulting to True).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from gateway.tokens.chat_template import TokenizerLoadError

NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                "mask_token")
# SGLang `_fix_v5_add_bos_eos_token`: classes whose add_bos_token (default True) it restores.
_BOS_FLAG_CLASSES = frozenset({"LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer",
                               "CodeLlamaTokenizerFast", "GemmaTokenizer", "GemmaTokenizerFast",
                               "CohereTokenizerFast"})
# Class defaults of transformers 5 tokenizer classes, for named tokens the config leaves out.
_CLASS_DEFAULT_TOKENS = dict.fromkeys(
    ("LlamaTokenizer", "LlamaTokenizerFast"),
    {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})


@dataclass
class TokenizerFiles:
    backend: Tokenizer
    directory: Path
    config: dict  # tokenizer_config.json (+ special_tokens_map.json)
    model_config: dict  # config.json
    specials: dict[str, str]  # named special tokens: chat-template variables


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"{path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any) -> AddedToken | None:
    """An AddedToken as transformers builds it from a config entry (str or dict)."""
    if isinstance(value, str):
        return AddedToken(value, special=True)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        keys = ("single_word", "lstrip", "rstrip", "normalized", "special")
        args = {k: bool(value[k]) for k in keys if k in value}
        return AddedToken(value["content"], **args)
    return None


def _add_config_tokens(backend: Tokenizer, config: dict, pad: str | None) -> dict[str, str]:
    """`TokenizersBackend.__init__`: tokenizer_config.json's added tokens, then the named and
    extra special tokens it lacks; returns the named special tokens (template variables)."""
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    defaults = dict(_CLASS_DEFAULT_TOKENS.get(str(config.get("tokenizer_class")), {}))
    if pad is not None:  # tokenizer.json's padding names a pad token
        defaults["pad_token"] = pad
    named: dict[str, Any] = {}
    for key in NAMED_TOKENS:  # transformers' SPECIAL_TOKENS_ATTRIBUTES order
        value = config[key] if key in config else defaults.get(key)
        if value is not None:
            named[key] = value
    extra: list[Any] = []
    for key, value in config.items():
        if key == "extra_special_tokens" and isinstance(value, list):
            extra = value
        elif key.endswith("_token") and key not in NAMED_TOKENS and (
                isinstance(value, str) or isinstance(value, dict)
                and value.get("__type") == "AddedToken"):
            named[key] = value
    if isinstance(config.get("extra_special_tokens"), dict):
        named.update(config["extra_special_tokens"])
    decoder = config.get("added_tokens_decoder") or {}
    to_add: list[Any] = [decoder[i] for i in sorted(decoder, key=int)]
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    present |= {_token_text(t) for t in to_add}
    for value in [*named.values(), *extra]:
        text = _token_text(value)
        if text is not None and text not in present:
            to_add.append(value)
            present.add(text)
    named_texts = {_token_text(v) for v in named.values()}
    tokens = []
    for value in to_add:
        token = _added_token(value)
        if token is not None and not token.special and token.content in named_texts:
            token = AddedToken(token.content, single_word=token.single_word,
                               lstrip=token.lstrip, rstrip=token.rstrip,
                               normalized=token.normalized, special=True)
        if token is not None:
            tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)
    return {k: _token_text(v) for k, v in named.items() if _token_text(v) is not None}


def _fix_bos(backend: Tokenizer, config: dict, bos: str | None) -> None:
    """SGLang `_fix_v5_add_bos_eos_token`: for Llama/Gemma/Cohere classes add_bos_token
    (missing: True) is restored and the post-processor rebuilt as transformers'
    `update_post_processor` builds it."""
    if config.get("tokenizer_class") not in _BOS_FLAG_CLASSES:
        return
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        add_bos = True
    if not add_bos:
        return
    if bos is None or backend.token_to_id(bos) is None:
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
        return
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, backend.token_to_id(bos))])


def read_tokenizer_files(target: Path) -> TokenizerFiles | None:
    """`target`: a model directory or a tokenizer.json file (its siblings are read too)."""
    directory = target.parent if target.is_file() else target
    tokenizer_json = target if target.is_file() else target / "tokenizer.json"
    if not tokenizer_json.is_file():
        return None
    try:
        backend = Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:
        raise TokenizerLoadError(f"{tokenizer_json}: {exc}") from exc
    padding = backend.padding
    backend.no_truncation()
    backend.no_padding()
    config = read_json(directory / "tokenizer_config.json")
    if "added_tokens_decoder" not in config:  # transformers' legacy special_tokens_map.json
        for key, value in read_json(directory / "special_tokens_map.json").items():
            config[key] = value
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    specials = _add_config_tokens(backend, config, (padding or {}).get("pad_token"))
    _fix_bos(backend, config, specials.get("bos_token"))
    return TokenizerFiles(backend, directory, config, read_json(directory / "config.json"),
                          specials)
