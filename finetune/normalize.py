"""Tweet normalisation, each step switchable; emoji and all other non-ASCII text are kept.

The paper's preprocessing: HTML entities decoded (the E-c tweets carry ``&amp;``, ``&lt;`` ...), URLs and
user mentions replaced by placeholders (they are unique strings that carry no emotion and waste
context), whitespace collapsed. Placeholders default to TweetEval's ``http`` and ``@user``, ordinary
tokens for a byte-level BPE or character model. The options are saved beside a model
(``to_dict``/``from_dict``) so that prediction normalises exactly as training did.
"""
from __future__ import annotations

import html
import re
from dataclasses import asdict, dataclass
from typing import Iterable

from ._io import strict_from_dict

# A URL runs to the next whitespace; trailing sentence punctuation is left outside it.
_URL = re.compile(r"(?:\bhttps?://|\bwww\.)\S+?(?=[.,;:!?)\]}'\"]*(?:\s|$))", re.IGNORECASE)
# Twitter handles are word characters; "a@b" (an e-mail) and a lone "@" are not mentions.
_MENTION = re.compile(r"(?<![\w@])@\w+")
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class TweetNormalizer:
    """Callable ``str -> str``. Steps run in this order: HTML entities, URLs, mentions, repeats, case,
    whitespace (entities first, so that an encoded ``&amp;`` inside a URL is part of the URL)."""

    html_entities: bool = True
    urls: bool = True
    mentions: bool = True
    whitespace: bool = True
    max_char_repeats: int | None = None  # e.g. 3: "soooooo" -> "sooo"; None keeps repeats
    lowercase: bool = False
    url_placeholder: str = "http"
    user_placeholder: str = "@user"

    def __post_init__(self):
        if self.max_char_repeats is not None and self.max_char_repeats < 1:
            raise ValueError(f"max_char_repeats must be >= 1 or None, got {self.max_char_repeats}")

    def __call__(self, text: str) -> str:
        if self.html_entities:
            text = html.unescape(text)
        if self.urls:
            text = _URL.sub(self.url_placeholder, text)
        if self.mentions:
            text = _MENTION.sub(self.user_placeholder, text)
        if self.max_char_repeats is not None:
            n = self.max_char_repeats
            text = re.sub(r"(.)\1{%d,}" % n, lambda m: m.group(1) * n, text, flags=re.DOTALL)
        if self.lowercase:
            text = text.lower()
        if self.whitespace:
            text = _WHITESPACE.sub(" ", text).strip()
        return text

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TweetNormalizer":
        return strict_from_dict(cls, d, "normalisation options")

    @classmethod
    def identity(cls) -> "TweetNormalizer":
        """Every step off: text passes through unchanged."""
        return cls(html_entities=False, urls=False, mentions=False, whitespace=False)


def normalize_tweet(text: str, normalizer: TweetNormalizer | None = None) -> str:
    return (normalizer or TweetNormalizer())(text)


def normalize_texts(texts: Iterable[str], normalizer: TweetNormalizer | None = None) -> list[str]:
    normalizer = normalizer or TweetNormalizer()
    return [normalizer(t) for t in texts]
