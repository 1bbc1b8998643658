"""Prompt material for real-model tests: token ids of plain text, different per seed."""

from __future__ import annotations

import random

from skippy_cache.runtime import Engine

_WORDS = ["the", "cache", "keeps", "state", "of", "every", "prefix", "that", "a", "server", "has", "seen", "so", "that", "a", "later", "request", "with", "the", "same", "system", "prompt", "tool", "list", "or", "conversation", "skips", "its", "prefill", "and", "answers", "sooner", "river", "mountain", "orange", "seven", "quietly", "build", "measure", "exact", "token", "model", "layer", "memory", "sequence", "copy", "lane", "batch", "decode", "sample", "history", "question", "answer", "document", "summary", "careful", "number", "letter", "window", "garden", "silver", "planet", "engine"]


def make_tokens(engine: Engine, n: int, seed: int) -> list[int]:
    """`n` token ids of plain English-like text, different for each seed."""
    rng = random.Random(seed)
    tokens: list[int] = []
    while len(tokens) < n:
        text = " ".join(rng.choice(_WORDS) for _ in range(200))
        tokens += engine.tokenize(" " + text, add_special=False)
    return tokens[:n]
