"""What a body may make the servers reach: files on their disks, URLs, code of the caller's.

SGLang trusts whoever calls its HTTP port. A body may name a file on the server's disk as an
image, video or audio input and the server reads it (`sglang/srt/utils/common.py`:
`get_image_bytes` opens any string starting with `/` or `file://`, `_normalize_video_input`
any path that is a file, `load_audio` any string that is neither a URL nor a `data:` URI),
`/dev/zero` included; it fetches any URL a body names (`download_remote_media`), from inside
the cluster; and with `--enable-custom-logit-processor` it unpickles and runs the callable a
body carries (`sampling/custom_logit_processor.py`, `dill.loads`). Behind a gateway whose port
strangers reach, a file path is never the caller's to give; a URL to fetch and code to run are
the operator's to allow (`--allow-media-urls`, `--allow-custom-logit-processor`). The parsers
call these checks while they walk the body anyway, and a body that needs a permission carries
it in `RequestView.needs`, which the endpoint compares with the gateway's settings.
"""

from __future__ import annotations

from gateway.errors import BadRequest, Forbidden

MEDIA_URLS = "media_urls"  # the servers fetch a URL the body names
LOGIT_PROCESSOR = "custom_logit_processor"  # the servers run a callable the body carries
NOTHING: frozenset[str] = frozenset()
_FLAGS = {MEDIA_URLS: "--allow-media-urls", LOGIT_PROCESSOR: "--allow-custom-logit-processor"}

# Fields SGLang's own processes set on a request and exchange among themselves
# (`GenerateReqInput`: the tokenizer manager's reply address, the encoder servers of an
# encoder-disaggregated deployment, the arrival time its metrics count from, the multimodal
# hand-off's bookkeeping): no HTTP client of SGLang sends them.
INTERNAL_FIELDS = ("http_worker_ipc", "encoder_urls", "received_time",
                   "need_wait_for_mm_inputs", "num_items_assigned")
MEDIA_FIELDS = {"image_data": "image", "video_data": "video", "audio_data": "audio"}
# the top-level fields `fields` looks at: a body without any (almost every one) skips it
GUARDED = frozenset((*INTERNAL_FIELDS, *MEDIA_FIELDS, LOGIT_PROCESSOR))
_REMOTE = ("http://", "https://")


def media_reference(value: object, kind: str, where: str) -> bool:
    """Whether `value`, an image, video or audio input, is a URL for the servers to fetch;
    BadRequest when it could name a file of theirs. Images: `get_image_bytes` reads `/...`
    and `file://...`, and decodes anything else that is no URL as base64. Video and audio:
    `_normalize_video_input` and `load_audio` read any other string as a path, so only a
    `data:` URI or a URL is taken."""
    if not isinstance(value, str):
        return False  # not a reference (precomputed features, or the server's 400)
    if value.startswith(_REMOTE):
        return True
    if value.startswith("data:"):
        return False
    if kind == "image" and not value.startswith("/") and not value[:5].lower() == "file:":
        return False
    hint = "inline as a data: URI" if kind == "image" else "as a data: URI or a URL"
    raise BadRequest(f"'{where}' may name a file on the servers; give the {kind} {hint}")


def fields(body: dict, generate: bool) -> frozenset[str]:
    """What a body's top-level fields need (a chat's messages: `part`); on `/generate`,
    BadRequest for fields no caller may set and media that name the servers' files. Asked
    only of a body holding one of `GUARDED`."""
    needs = {LOGIT_PROCESSOR} if body.get(LOGIT_PROCESSOR) is not None else set()
    if generate:
        for name in INTERNAL_FIELDS:
            if body.get(name) is not None:
                raise BadRequest(f"'{name}' is set by SGLang's own processes; do not send it")
        for name, kind in MEDIA_FIELDS.items():
            if body.get(name) is not None and _media_tree(body[name], kind, name):
                needs.add(MEDIA_URLS)
    return frozenset(needs) if needs else NOTHING


def _media_tree(value: object, kind: str, where: str) -> bool:
    """Whether any input of a `/generate` media field (one, a list, a list per prompt; an
    item may be an object with a `url`) is a URL for the servers to fetch."""
    remote, stack = False, [value]
    while stack:  # (no recursion: a body may nest as deep as the JSON parser allows)
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            remote |= media_reference(item.get("url"), kind, where)
        else:
            remote |= media_reference(item, kind, where)
    return remote


# A content part's type -> (the field holding its reference, the kind of media): OpenAI chat
# parts (`ChatCompletionMessageContentImagePart` and the video and audio ones), Responses'
# `input_image` (`serving_responses._normalize_response_content_part_for_chat`) and
# Anthropic's `image` block (`serving._convert_anthropic_image_source_to_openai_part`).
_PARTS = {"image_url": ("image_url", "image"), "input_image": ("image_url", "image"),
          "video_url": ("video_url", "video"), "audio_url": ("audio_url", "audio"),
          "image": ("source", "image")}


def part(item: dict, where: str) -> bool:
    """Whether a content part is media the servers would fetch from a URL; BadRequest when
    it names their files. A part that is not media: False."""
    kind = item.get("type")
    shape = _PARTS.get(kind) if type(kind) is str else None  # (a list is no key: no 500)
    if shape is None:
        return False
    field, kind = shape
    reference = item.get(field)
    if isinstance(reference, dict):
        if kind == "image" and field == "source" and reference.get("type") == "base64":
            return False  # Anthropic's inline image: made a data: URI by SGLang
        reference = reference.get("url")
    return media_reference(reference, kind, f"{where}.{field}")


def items_fetch(items: object, where: str, depth: int = 2) -> bool:
    """Whether media among a conversation's items is fetched by URL: the parts of an item's
    `content` or `output` list, and of the lists of those parts in turn (Anthropic's
    `tool_result` holds blocks; a Responses tool output holds parts), `depth` levels down.
    Not the tools' arguments: those are the model's JSON, never media the server loads."""
    if not isinstance(items, list):
        return False
    remote = False
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        for key in ("content", "output"):
            blocks = item.get(key)
            if not isinstance(blocks, list):
                continue
            for j, block in enumerate(blocks):
                if isinstance(block, dict):
                    remote |= part(block, f"{where}[{i}].{key}[{j}]")
            if depth > 1:
                remote |= items_fetch(blocks, f"{where}[{i}].{key}", depth - 1)
    return remote


def refuse_unallowed(needs: frozenset[str], allowed: frozenset[str]) -> None:
    """403 for a body that needs what the operator did not allow, naming the setting."""
    missing = needs - allowed
    if missing:
        name = min(missing)
        what = ("names media by URL for the servers to fetch" if name == MEDIA_URLS
                else "carries a custom logit processor for the servers to run")
        raise Forbidden(f"this request {what}, which this gateway does not allow "
                        f"(its operator may, with {_FLAGS[name]})")
