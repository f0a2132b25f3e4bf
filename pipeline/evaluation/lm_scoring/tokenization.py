"""The little the evaluations need from a tokenizer, over Hugging Face tokenizers and raw bytes.

``encode`` never adds special tokens; ``prefix`` is what the tokenizer itself
puts before a text (e.g. Llama's BOS, nothing for GPT-2), so a model is scored
on the inputs it was trained on. ``start_id`` is a token that may stand before
a document (BOS, else EOS, as GPT-2's <|endoftext|>), for scoring a text's very
first token.
"""
from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    name: str
    prefix: list[int]
    start_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class HFTokenizer:
    """Adapter for a ``transformers`` tokenizer."""

    def __init__(self, tokenizer, name: str | None = None):
        self.tokenizer = tokenizer
        self.name = name or getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        self.prefix = _special_prefix(tokenizer)
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        self.start_id = bos if bos is not None else eos

    def encode(self, text: str) -> list[int]:
        # verbose=False: a whole test set is longer than the model and that is intended here.
        return list(self.tokenizer.encode(text, add_special_tokens=False, verbose=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def _special_prefix(tokenizer) -> list[int]:
    """The ids a tokenizer puts in front of a text when it adds its special tokens."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return list(full[:i])
    return []


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255, for byte-level (character) models."""

    def __init__(self, start_id: int | None = None):
        self.name = "utf-8 bytes"
        self.prefix: list[int] = []
        self.start_id = start_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
