"""A tiny tokenizer model made here (the CPU rig's recipe: a byte-level BPE trained in
memory) with a chat template: for the tests and benchmarks that need a served model's
tokenizer (`python -m backends.tiny_tokenizer DIR` writes one)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
PLAIN = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
         "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def train() -> Tokenizer:
    """A byte-level BPE of 400 tokens trained on a few words (milliseconds)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    words = "the quick brown fox jumps over lazy dog hello world tell me a story".split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(9)) for i in range(300)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def write_model(directory: Path, trained: Tokenizer, template: str | None = PLAIN,
                bos_post_processor: bool = False, **config) -> Path:
    """A model directory: tokenizer.json and tokenizer_config.json (with `template`)."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_str(trained.to_str())
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 0)])
    tok.save(str(directory / "tokenizer.json"))
    settings = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                "tokenizer_class": "TokenizersBackend", **config}
    if template is not None:
        settings["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


if __name__ == "__main__":
    import sys

    print(write_model(Path(sys.argv[1]), train()))
