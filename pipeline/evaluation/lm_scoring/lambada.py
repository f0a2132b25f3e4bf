"""LAMBADA last-word prediction, strict as in Megatron-LM (``--strict-lambada``).

The target is the passage's last space-separated word. The context (text
before that space) and ``" " + word`` are tokenized separately, so the word's
tokens are the ones the model must produce. A passage counts as right only if
greedy decoding reproduces every token of the word; with teacher forcing that
is "the argmax at each target position is the target token", one forward pass.
Also reported: the per-token variant (fraction of target tokens predicted
right) and lm-evaluation-harness's perplexity of the target word,
exp(mean over passages of the word's NLL).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pipeline.job.errors import InputError
from pipeline.evaluation.lm_scoring.parallel import DataShard
from pipeline.evaluation.lm_scoring.scoring import Scorer, check_context_length
from pipeline.evaluation.lm_scoring.tokenization import Tokenizer
from pipeline.evaluation.lm_scoring.wikitext import safe_exp


@dataclass(frozen=True)
class LambadaExample:
    context: str
    target: str  # the last word, without its leading space
    line: int    # 1-based line in the file


def load_lambada(path: str | Path, max_examples: int | None = None) -> list[LambadaExample]:
    """Read a LAMBADA JSON-lines file: one ``{"text": ...}`` per line (blank lines are skipped)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"LAMBADA file {path} does not exist")
    if max_examples is not None and max_examples < 1:
        raise InputError(f"max_examples must be >= 1, got {max_examples}")
    examples = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if max_examples is not None and len(examples) >= max_examples:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}, line {lineno}: invalid JSON at column {e.colno}: {e.msg}") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise InputError(f"{path}, line {lineno}: expected an object with a string field \"text\", "
                                 f"got {line.strip()[:80]!r}")
            context, sep, target = text.rstrip().rpartition(" ")
            if not sep or not context.strip() or not target:
                raise InputError(f"{path}, line {lineno}: the text needs a context and a last word "
                                 f"separated by a space, got {text[:80]!r}")
            examples.append(LambadaExample(context, target, lineno))
    return examples


def encode_example(example: LambadaExample, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """(context ids with the tokenizer's prefix, target word ids)."""
    return tokenizer.prefix + tokenizer.encode(example.context), tokenizer.encode(" " + example.target)


def evaluate_lambada(scorer: Scorer, tokenizer: Tokenizer, examples: list[LambadaExample], *,
                     context_length: int, batch_size: int = 1, shard: DataShard | None = None,
                     progress: bool = True) -> dict:
    """Strict last-word accuracy, per-token accuracy and counts.

    A passage longer than ``context_length + 1`` tokens loses context tokens from the left.
    """
    check_context_length(scorer, context_length)
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    shard = shard or DataShard()
    encoded, truncated = [], 0
    for ex in examples:
        ctx, tgt = encode_example(ex, tokenizer)
        if not tgt:
            raise InputError(f"line {ex.line}: the last word {ex.target!r} encodes to no tokens")
        keep = context_length + 1 - len(tgt)
        if keep < 1:
            raise InputError(f"line {ex.line}: the last word alone has {len(tgt)} tokens, more than "
                             f"context_length {context_length} allows")
        if len(ctx) > keep:
            ctx, truncated = ctx[-keep:], truncated + 1
        encoded.append((ctx, tgt))
    # Longest first, so each batch holds passages of similar length (little padding).
    order = sorted(range(len(encoded)), key=lambda i: -sum(map(len, encoded[i])))
    batches = shard.take([order[i:i + batch_size] for i in range(0, len(order), batch_size)])

    # Per example: words right, target tokens, tokens right, target NLL.
    sums = torch.zeros(4, dtype=torch.float64)
    for batch in tqdm(batches, desc="lambada", unit="batch", disable=not progress, dynamic_ncols=True):
        seqs = [encoded[i][0] + encoded[i][1] for i in batch]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)  # right padding (id 0): never scored
        for row, seq in zip(ids, seqs):
            row[:len(seq)] = torch.tensor(seq)
        out = scorer(ids, greedy=True)
        nll, greedy = out.nll.double().cpu(), out.greedy.cpu()
        for r, i in enumerate(batch):
            ctx, tgt = encoded[i]
            # Target token j sits at position len(ctx) + j, predicted at row index len(ctx) + j - 1.
            span = slice(len(ctx) - 1, len(ctx) - 1 + len(tgt))
            right = greedy[r, span] == torch.tensor(tgt)
            sums += torch.tensor([float(right.all()), len(tgt), right.sum().item(), nll[r, span].sum().item()],
                                 dtype=torch.float64)
    sums = shard.sum(sums, scorer.device)
    correct, num_target_tokens, correct_tokens, target_nll = sums.tolist()
    n = len(examples)
    return {
        "accuracy": correct / n if n else float("nan"),
        "token_accuracy": correct_tokens / num_target_tokens if n else float("nan"),
        "target_perplexity": safe_exp(target_nll / n) if n else float("nan"),
        "num_examples": n,
        "num_correct": int(correct),
        "num_target_tokens": int(num_target_tokens),
        "num_correct_tokens": int(correct_tokens),
        "num_tokens": sum(len(c) + len(t) for c, t in encoded),  # context (after truncation) + target
        "num_multi_token_targets": sum(len(t) > 1 for _, t in encoded),
        "num_truncated": truncated,
    }
