"""Tokens: the served model's tokenizer, chat template, messages, tools, prompt counts, context check."""
