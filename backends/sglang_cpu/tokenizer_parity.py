"""Do the gateway's text token ids (gateway/tokens/tokenizer.py) equal SGLang's for a model directory?

Run with a python that has SGLang (the CPU rig's, or a GPU server's image), from the repo root:

    /opt/sglang-rig/venv/bin/python backends/sglang_cpu/tokenizer_parity.py MODEL_DIR [...]

For each directory it loads the tokenizer with SGLang's own `get_tokenizer` (transformers 5
and SGLang's post-load fixes) and with `gateway.tokens.tokenizer.load_tokenizer`, encodes a corpus
(ASCII, unicode, whitespace runs, the model's special tokens) both ways, as
`TokenizerManager._tokenize_texts` does (`tokenizer(texts)`), and reports the texts whose ids
differ; the exit status is 1 if any do. This is how to check a tokenizer the gateway calls
"approximate" (a tokenizer class transformers rebuilds). Chat prompts are proven against a
running server instead: tests/e2e_sglang/test_tokenizer.py.

`--json` reads {"paths": [...], "texts": [...]} on stdin and writes SGLang's ids only
({path: {"ids": [[...]], "class": NAME}}), for the end-to-end tests.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CORPUS = [
    "hello world", " leading space", "trailing space ", "many     inner      spaces",
    "tabs\tand\ttabs", "new\nlines\n\n\nand more", "\r\nwindows\r\n", "   ", "\n", "x",
    "0123456789 3.14159", "!?.,:;'\"()[]{}<>/\\|-_=+*&^%$#@~`", "can't won't",
    "café naïve résumé", "日本語のテキスト", "中文测试", "한국어", "русский", "العربية",
    "emoji 🎉🚀👍🏽 👨‍👩‍👧", "combining e\u0301", "zero\u200bwidth", "nbsp\u00a0here",
    "def f(x):\n    return x  # code\n", "The quick brown fox jumps over the lazy dog. " * 20,
]


def sglang_ids(paths: list[str], texts: list[str]) -> dict:
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer  # noqa: PLC0415

    answer = {}
    for path in paths:
        tokenizer = get_tokenizer(path)
        answer[path] = {"ids": tokenizer(texts)["input_ids"], "class": type(tokenizer).__name__,
                        "specials": list(getattr(tokenizer, "all_special_tokens", []))}
    return answer


def compare(path: str) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from gateway.tokens.tokenizer import load_tokenizer  # noqa: PLC0415

    gateway = load_tokenizer(path)
    if gateway is None:
        print(f"{path}: no tokenizer.json")
        return 1
    first = sglang_ids([path], CORPUS)[path]
    specials = first["specials"]
    texts = CORPUS + [" ".join(specials), "a" + "b".join(specials) + "c"] + [
        f"{s}text {s} " for s in specials]
    reference = sglang_ids([path], texts)[path]
    bad = [t for t, ids in zip(texts, reference["ids"], strict=True)
           if gateway.encode_text(t) != ids]
    print(f"{path}: SGLang loads {reference['class']}; gateway: {gateway.describe()}")
    print(f"  {len(texts) - len(bad)}/{len(texts)} texts give the same ids")
    for text in bad[:10]:
        print(f"  differs: {text[:60]!r}")
    gateway.close()
    return 1 if bad else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*")
    parser.add_argument("--json", action="store_true", help="SGLang's ids for stdin's request")
    args = parser.parse_args()
    if args.json:
        request = json.load(sys.stdin)
        json.dump(sglang_ids(request["paths"], request["texts"]), sys.stdout)
        return
    sys.exit(max((compare(p) for p in args.paths), default=0))


if __name__ == "__main__":
    main()
