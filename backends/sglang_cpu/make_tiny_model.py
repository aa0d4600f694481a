"""Generate a tiny random Llama model plus a locally trained tokenizer for the CPU rig.

Why: end-to-end tests need a real model directory SGLang can load, but this machine cannot reach
a model hub, and a real model would be far too slow on 2 CPU cores. A 2-layer, 64-wide
`LlamaForCausalLM` with fixed-seed random weights loads in a second and decodes deterministically
(greedy), which is all PD tests need: the same output from a PD pair and from a plain server.

Run it with the rig's python (it needs torch, transformers and tokenizers):
    /opt/sglang-rig/venv/bin/python backends/sglang_cpu/make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 1234
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are or not "
    "prefill decode cache token request server gateway model route batch stream latency "
    "user assistant system hello world please tell me about story number one two three "
    "four five six seven eight nine ten quick brown fox jumps over lazy dog"
).split()


def training_corpus(lines: int = 2000) -> list[str]:
    """Deterministic pseudo-English text, so the tokenizer is the same on every run."""
    rng = random.Random(SEED)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(lines)]
    corpus += [str(n) for n in range(1000)] + ["!?.,:;'\"()[]{}<>/\\|-_=+*&^%$#@~`\n\t"]
    return corpus


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (every byte encodable), trained in memory, with a chat template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.model_max_length = 2048
    return wrapped


def build_model(vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> LlamaForCausalLM:
    """hidden 64, 2 layers, 4 heads, 2 KV heads, bf16, random weights from a fixed seed."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        initializer_range=0.5,  # wide logits so greedy output varies with the prompt
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16)


def make_tiny_model(out_dir: Path, vocab_size: int = 512) -> Path:
    """Write model and tokenizer into out_dir (created if needed); returns out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    padded_vocab = -(-len(tokenizer) // 64) * 64
    model = build_model(
        padded_vocab, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    print(make_tiny_model(args.out_dir, args.vocab_size))


if __name__ == "__main__":
    main()
