"""The model's Jinja chat template, rendered the way SGLang 0.5.23 renders it (through
transformers 5's `apply_chat_template`), with the kept `jinja2` library.

What is mirrored (transformers `utils/chat_template_utils.py`, `tokenization_utils_base.py`):

* the environment: `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with
  the `loopcontrols` extension, a `{% generation %}` block tag (renders its body; transformers
  uses it only for assistant masks), a `tojson` filter that is `json.dumps(ensure_ascii=False)`
  (Jinja's own escapes HTML), and the globals `raise_exception` (raises `TemplateError`) and
  `strftime_now`;
* the variables: the tokenizer's named special tokens (`bos_token`, `eos_token`, ... and the
  model-specific `*_token` entries of tokenizer_config.json), overridden by the request's
  `chat_template_kwargs`, then `messages`, `tools`, `documents`, `add_generation_prompt`;
* where the template comes from (`_from_pretrained`): `chat_template.jinja` and
  `additional_chat_templates/*.jinja` win over `chat_template` in tokenizer_config.json (a string,
  or a list of named templates); several templates make a dict, of which SGLang
  (`TemplateManager._select_named_template`) takes `--hf-chat-template-name` or else the first.
  `chat_template.json` (the legacy processor file) is read last;
* SGLang's content-format detection (`parser/jinja_template_utils.py`
  `detect_jinja_template_content_format`): "openai" when the template loops over a message's
  content (or mentions image/audio/video/vision), else "string".
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TokenizerError(Exception):
    """Base of the tokenizer's errors: the caller goes on without token ids."""


class TokenizerLoadError(TokenizerError):
    """The tokenizer files are there but cannot be read."""


class UnsupportedRequest(TokenizerError):
    """SGLang would take a path the gateway does not mirror (multimodal content, a custom
    encoder, a request-supplied template...): the gateway cannot know the ids."""


class RejectedRequest(TokenizerError):
    """SGLang would refuse this request (400): invalid messages, or the template raised."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers tracks assistant spans with it;
    for the rendered text it is just its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# apply_chat_template's own parameters: a chat_template_kwargs key with one of these names is
# consumed by the call, not passed to the template (or clashes with what SGLang passes).
_CLASHING_KWARGS = frozenset({"conversation", "tools", "add_generation_prompt", "tokenize",
                              "return_dict", "conversations", "messages"})
_IGNORED_KWARGS = frozenset({"padding", "truncation", "max_length", "return_tensors",
                             "tokenizer_kwargs"})
_ERROR_IF_TRUE_KWARGS = frozenset({"continue_final_message", "return_assistant_tokens_mask"})


class ChatTemplate:
    """One compiled template plus the variables every rendering gets."""

    def __init__(self, source: str, special_tokens: dict[str, str], name: str = "default"):
        self.source = source
        self.name = name
        self.special_tokens = dict(special_tokens)
        env = _environment()
        try:
            self._template = env.from_string(source)
            ast = env.parse(source)
        except jinja2.TemplateError as exc:
            raise TokenizerLoadError(f"chat template {name!r} does not compile: {exc}") from exc
        self.content_format = _content_format(source, ast)

    def render(self, messages: list[dict], tools: list[dict] | None,
               kwargs: dict[str, Any], add_generation_prompt: bool = True) -> str:
        """`tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
        add_generation_prompt=..., **kwargs)`. Raises RejectedRequest where that raises."""
        variables = dict(kwargs)
        documents = None
        for key in list(variables):
            if key in _CLASHING_KWARGS:
                raise RejectedRequest(f"chat_template_kwargs may not set {key!r}")
            if key in _IGNORED_KWARGS:
                del variables[key]
            elif key in _ERROR_IF_TRUE_KWARGS:
                if variables.pop(key):
                    raise RejectedRequest(f"chat_template_kwargs {key!r} is not supported here")
            elif key == "documents":
                documents = variables.pop(key)
            elif key == "chat_template":
                raise UnsupportedRequest("a request-supplied chat_template")
        if documents is not None:
            if not isinstance(documents, list | tuple) or not all(
                    isinstance(d, dict) for d in documents):
                raise RejectedRequest("documents should be a list of dicts")
        if not messages:
            raise RejectedRequest("cannot apply the chat template to an empty conversation")
        variables = {**self.special_tokens, **variables}
        try:
            return self._template.render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt,
                                         **variables)
        except Exception as exc:  # TemplateError, TypeError, ... all answer 400 in SGLang
            raise RejectedRequest(f"chat template: {exc}") from exc


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return (_is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const)
                and node.arg.value == key)
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _accesses(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    """SGLang's `_is_var_or_elems_access(node, name, key)`: through filters, tests, slices."""
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _accesses(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _accesses(node.node, name, key)
    return _is_attr(node, name, key)


def _content_format(source: str, ast: jinja2.nodes.Template) -> str:
    if any(word in source for word in ("image", "audio", "video", "vision")):
        return "openai"
    for loop in ast.find_all(jinja2.nodes.For):
        if any(_accesses(loop.iter, name, "content") for name in ("message", "msg", "m")):
            return "openai"
    return "string"


def find_chat_templates(directory: Path, tokenizer_config: dict) -> dict[str, str]:
    """All templates transformers would load for this directory, in its order."""
    templates: dict[str, str] = {}
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    configured = tokenizer_config.get("chat_template")
    if isinstance(configured, str):
        return {"default": configured}
    if isinstance(configured, list):
        return {t["name"]: t["template"] for t in configured
                if isinstance(t, dict) and isinstance(t.get("template"), str)}
    legacy = directory / "chat_template.json"
    if legacy.is_file():
        try:
            value = json.loads(legacy.read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError) as exc:
            raise TokenizerLoadError(f"{legacy}: {exc}") from exc
        if isinstance(value, str):
            return {"default": value}
    return {}


def select_chat_template(templates: dict[str, str], name: str | None) -> tuple[str, str] | None:
    """(name, source) as SGLang picks it: the named one, else the first; None without any."""
    if not templates:
        return None
    if name is not None:
        if name not in templates:
            raise TokenizerLoadError(
                f"chat template {name!r} not found; the model has {sorted(templates)}")
        return name, templates[name]
    first = next(iter(templates))
    return first, templates[first]
