"""Bits per character (and per byte) of a held-out text.

bits per character = total NLL (nats) / ln 2 / characters scored. For a
byte-level model (the mLSTM papers' "character" is a UTF-8 byte) that is the
bits per byte below; for a BPE model bits per byte is the tokenizer-independent
figure to compare models by (a character may be several bytes).

Every character is scored: the text is preceded by the tokenizer's start token
(BOS, else EOS, like lm-evaluation-harness's rolling log-likelihood) unless the
tokenizer adds a prefix itself. A tokenizer with neither leaves its first token
unscored, and that token's characters are left out of the counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pipeline.job.errors import InputError
from pipeline.job.files import read_utf8_text
from pipeline.evaluation.lm_scoring.parallel import DataShard
from pipeline.evaluation.lm_scoring.scoring import Scorer, score_token_stream
from pipeline.evaluation.lm_scoring.tokenization import Tokenizer


@dataclass
class HeldOutText:
    path: str
    text: str
    num_lines: int


def load_text(path: str | Path, max_lines: int | None = None) -> HeldOutText:
    """A UTF-8 text file, whole or its first ``max_lines`` lines."""
    path = Path(path)
    text = read_utf8_text(path, "text file")
    lines = text.splitlines(keepends=True)
    if max_lines is not None:
        if max_lines < 1:
            raise InputError(f"max_lines must be >= 1, got {max_lines}")
        lines = lines[:max_lines]
        text = "".join(lines)
    if not text:
        raise InputError(f"text file {path} is empty")
    return HeldOutText(str(path), text, len(lines))


def evaluate_bpc(scorer: Scorer, tokenizer: Tokenizer, data: HeldOutText, *, context_length: int, stride: int,
                 batch_size: int = 1, shard: DataShard | None = None, progress: bool = True) -> dict:
    body = tokenizer.encode(data.text)
    prefix = tokenizer.prefix or ([tokenizer.start_id] if tokenizer.start_id is not None else [])
    ids = prefix + body
    unscored_text = "" if prefix else tokenizer.decode(body[:1])
    chars = len(data.text) - len(unscored_text)
    num_bytes = len(data.text.encode("utf-8")) - len(unscored_text.encode("utf-8"))
    stream = score_token_stream(scorer, ids, context_length=context_length, stride=stride, batch_size=batch_size,
                                shard=shard, progress=progress, desc="bpc")
    bits = stream.total_nll / math.log(2)
    return {
        "bits_per_character": bits / chars,
        "bits_per_byte": bits / num_bytes,
        "bits_per_token": bits / stream.num_scored,
        "total_nll": stream.total_nll,
        "num_characters": chars,
        "num_bytes": num_bytes,
        "num_tokens": len(body),
        "num_scored_tokens": stream.num_scored,
        "num_lines": data.num_lines,
        "num_windows": stream.num_windows,
        "start_token": prefix[0] if prefix else None,
        "unscored_characters": len(unscored_text),
        "mean_context": stream.mean_context,
        "loss_by_context": stream.loss_by_context(),
    }
