"""WikiText perplexity as Megatron-LM reports it.

The test file is WikiText's own tokenization (" @-@ ", spaces around
punctuation, "<unk>"). Megatron turns it back into running text before a BPE
model sees it, scores the whole test set as one token stream with overlapping
windows, and reports two numbers:

* token perplexity  exp(total NLL / scored BPE tokens), and
* word perplexity   exp(total NLL / (original words - 1)), the number comparable
  with word-level models; "original words" is the count of space-separated
  pieces of the file as given (``text.strip().split(" ")``), which counts one
  piece per line end, like the "<eos>" of the standard WikiText word count.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.job.errors import InputError
from pipeline.job.files import read_utf8_text
from pipeline.evaluation.lm_scoring.scoring import DataShard, Scorer, score_token_stream
from pipeline.evaluation.lm_scoring.tokenization import Tokenizer

# --- detokenizer ---------------------------------------------------------------
# Megatron-LM's wikitext_detokenizer, rule for rule and in the same order (the
# order matters: quotes are paired before " 's" is glued back). Megatron also runs
# re.sub(r"/' [0-9]/", ...), which matches only a literal slash and so never
# changes WikiText; it is left out.
_BEFORE_PAIRS = (
    ("s '", "s'"),                      # plural possessive: "players ' union"
    (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),  # joiners inside words and numbers
    (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "),
)
# Brackets and quotes: drop the spaces just inside each (non-nested) pair.
_PAIRS = tuple((re.compile(rf"{re.escape(o)}\s*([^{re.escape(c)}]*?)\s*{re.escape(c)}"), o, c)
               for o, c in (("(", ")"), ("[", "]"), ("{", "}"), ('"', '"'), ("'", "'")))
_AFTER_PAIRS = (
    ("= = = =", "===="), ("= = =", "==="), ("= =", "=="),  # section heading markers
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    (" \n", "\n"), ("\n ", "\n"),       # the space WikiText puts around every line
    (" N ", " 1 "),                     # numbers replaced by N (Penn Treebank style)
    (" 's", "'s"),
)


def wikitext_detokenize(text: str) -> str:
    """WikiText's tokenized text turned back into running text, as Megatron-LM does it."""
    for old, new in _BEFORE_PAIRS:
        text = text.replace(old, new)
    for pattern, open_, close in _PAIRS:
        text = pattern.sub(lambda m: open_ + m.group(1) + close, text)
    for old, new in _AFTER_PAIRS:
        text = text.replace(old, new)
    return text


# --- data ----------------------------------------------------------------------
_ARTICLE_TITLE = re.compile(r" = [^=].* = ")  # " = Title = "; sections are " = = Section = = "


@dataclass
class WikiText:
    path: str
    text: str            # as in the file (WikiText tokenization), possibly cut to the first articles
    num_lines: int
    num_articles: int
    num_words: int       # Megatron's "original tokens": len(text.strip().split(" "))

    @property
    def detokenized(self) -> str:
        return wikitext_detokenize(self.text)


def load_wikitext(path: str | Path, max_articles: int | None = None) -> WikiText:
    """Read a WikiText file (``wiki.test.tokens`` / ``test.txt`` or the ``.raw`` variant).

    ``max_articles`` keeps the text up to the start of article ``max_articles + 1``.
    """
    path = Path(path)
    text = read_utf8_text(path, "WikiText file")
    lines = text.splitlines(keepends=True)
    titles = [i for i, line in enumerate(lines) if _ARTICLE_TITLE.fullmatch(line.rstrip("\n"))]
    if not titles:
        raise InputError(f"WikiText file {path}: no article title line (' = Title = ') found; "
                         f"is this a WikiText file?")
    if max_articles is not None:
        if max_articles < 1:
            raise InputError(f"max_articles must be >= 1, got {max_articles}")
        if max_articles < len(titles):
            # Stop before the blank line that precedes the next article's title.
            lines = lines[:titles[max_articles] - 1]
            titles = titles[:max_articles]
            text = "".join(lines)
    return WikiText(path=str(path), text=text, num_lines=len(lines), num_articles=len(titles),
                    num_words=len(text.strip().split(" ")))


# --- evaluation ----------------------------------------------------------------
def evaluate_wikitext(scorer: Scorer, tokenizer: Tokenizer, data: WikiText, *, context_length: int, stride: int,
                      batch_size: int = 1, shard: DataShard | None = None, progress: bool = True) -> dict:
    """Token and word-level perplexity of ``data`` (detokenized first, as Megatron does)."""
    ids = tokenizer.prefix + tokenizer.encode(data.detokenized)
    stream = score_token_stream(scorer, ids, context_length=context_length, stride=stride, batch_size=batch_size,
                                shard=shard, progress=progress, desc="wikitext")
    total, scored = stream.total_nll, stream.num_scored
    token_loss = total / scored
    word_loss = total / (data.num_words - 1)  # Megatron: token loss x (tokens - 1) / (words - 1)
    return {
        "token_perplexity": safe_exp(token_loss),
        "word_perplexity": safe_exp(word_loss),
        "token_loss": token_loss,
        "word_loss": word_loss,
        "total_nll": total,
        "num_tokens": len(ids),
        "num_scored_tokens": scored,
        "num_words": data.num_words,
        "token_ratio": scored / (data.num_words - 1),
        "num_windows": stream.num_windows,
        "num_articles": data.num_articles,
        "num_lines": data.num_lines,
        "mean_context": stream.mean_context,
        "loss_by_context": stream.loss_by_context(),
    }


def safe_exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
