"""Scorers (a model as "token ids -> per-token NLL and greedy predictions") and sliding-window scoring.

A scorer reads ids [b, s], runs the model on ``ids[:, :-1]`` and scores it
against ``ids[:, 1:]`` (the project's shifted-label convention), giving

    nll[:, t]    = -log p(ids[:, t + 1] | ids[:, :t + 1])      (nats, fp32)
    greedy[:, t] = argmax_v p(v | ids[:, :t + 1])               (when asked for)

Rows may be right-padded: a causal model's scores at a position do not depend
on later tokens, so the caller just ignores the padded positions.

Adapters: ``HFScorer`` (any ``transformers`` causal LM) and ``GPTScorer`` (the
project's GPT at any tensor- and context-parallel size: vocabulary-parallel logits
are never gathered; each rank of a TP x CP group gets the same, full result).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from pipeline.families.common import ProjectScorer, TokenScores
from pipeline.families.gpt.parts import GPTScorer
from pipeline.families.mlstm.parts import MLSTMScorer
from pipeline.job.errors import InputError
from pipeline.evaluation.lm_scoring.parallel import DataShard

__all__ = ["TokenScores", "Scorer", "HFScorer", "hf_max_positions", "ProjectScorer", "GPTScorer", "MLSTMScorer",
           "Window", "sliding_windows", "StreamScore", "score_token_stream", "check_context_length"]


class Scorer(Protocol):
    max_positions: int | None  # longest input the model reads in one call (None: no limit)
    device: torch.device

    def __call__(self, ids: torch.Tensor, *, greedy: bool = False) -> TokenScores: ...


class HFScorer:
    """A Hugging Face causal LM (``AutoModelForCausalLM``)."""

    def __init__(self, model, max_positions: int | None = None):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.max_positions = max_positions or hf_max_positions(model.config)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, *, greedy: bool = False) -> TokenScores:
        ids = ids.to(self.device)
        logits = self.model(input_ids=ids[:, :-1], use_cache=False).logits
        targets = ids[:, 1:]
        # Row by row: the fp32 copy of [s, vocab] logits is made for one row at a time.
        nll = torch.stack([F.cross_entropy(row.float(), t, reduction="none") for row, t in zip(logits, targets)])
        return TokenScores(nll, logits.argmax(-1) if greedy else None)


def hf_max_positions(config) -> int | None:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# --- sliding windows over one long token stream -------------------------------
@dataclass(frozen=True)
class Window:
    """The model reads tokens[start:end-1]; targets tokens[first:end] are scored (first > start)."""
    start: int
    end: int
    first: int


def sliding_windows(num_tokens: int, context_length: int, stride: int) -> list[Window]:
    """Windows that score every token but the first exactly once, each with as much left context as fits.

    A window holds ``context_length + 1`` tokens (the model reads ``context_length``).
    The first window scores all its targets; each next one moves ``stride`` tokens
    on and scores only those, so a token sees at least ``context_length - stride + 1``
    tokens of context (Megatron's ``--overlapping-eval`` is the stride). The last
    window is pulled back to end at the last token rather than padded, so it too
    has a full context.
    """
    if context_length < 1:
        raise InputError(f"context_length must be >= 1, got {context_length}")
    if not 1 <= stride <= context_length:
        raise InputError(f"stride must be between 1 and context_length ({context_length}), got {stride}")
    if num_tokens < 2:
        return []
    end = min(context_length + 1, num_tokens)
    windows = [Window(0, end, 1)]
    while end < num_tokens:
        new_end = min(end + stride, num_tokens)
        windows.append(Window(new_end - context_length - 1, new_end, end))
        end = new_end
    return windows


@dataclass
class StreamScore:
    token_nll: torch.Tensor     # [T] float64, NLL of each token given its left context; NaN for token 0
    times_scored: torch.Tensor  # [T] int64: 1 for every token but the first
    context: torch.Tensor       # [T] int64: tokens of left context each token was scored with
    num_windows: int

    @property
    def scored(self) -> torch.Tensor:
        return self.times_scored > 0

    @property
    def total_nll(self) -> float:
        return self.token_nll[self.scored].sum().item()

    @property
    def num_scored(self) -> int:
        return int(self.scored.sum())

    @property
    def mean_context(self) -> float:
        return self.context[self.scored].double().mean().item() if self.num_scored else 0.0

    def loss_by_context(self) -> list[dict]:
        """Mean NLL of the tokens scored with 1, 2-3, 4-7, ... tokens of left context."""
        ctx, nll = self.context[self.scored], self.token_nll[self.scored]
        rows, lo = [], 1
        while ctx.numel() and lo <= int(ctx.max()):
            inside = (ctx >= lo) & (ctx < 2 * lo)
            if inside.any():
                rows.append({"context_from": lo, "context_to": 2 * lo - 1, "tokens": int(inside.sum()),
                             "mean_nll": nll[inside].mean().item()})
            lo *= 2
        return rows


def score_token_stream(scorer: Scorer, ids: Sequence[int] | torch.Tensor, *, context_length: int, stride: int,
                       batch_size: int = 1, shard: DataShard | None = None, progress: bool = True,
                       desc: str = "scoring") -> StreamScore:
    """Per-token NLL of a long token stream scored with overlapping windows (see ``sliding_windows``).

    With a ``shard`` over data-parallel replicas each replica scores its share of
    the windows and the result is summed (every replica must call this).
    """
    check_context_length(scorer, context_length)
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    shard = shard or DataShard()
    tokens = torch.as_tensor(ids, dtype=torch.long)
    n = tokens.numel()
    windows = sliding_windows(n, context_length, stride)
    mine = shard.take(windows)
    token_nll = torch.zeros(n, dtype=torch.float64)
    times = torch.zeros(n, dtype=torch.long)
    context = torch.zeros(n, dtype=torch.long)
    batches = [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
    with tqdm(total=len(mine), desc=desc, unit="window", disable=not progress, dynamic_ncols=True) as bar:
        for batch in batches:
            out = scorer(torch.stack([tokens[w.start:w.end] for w in batch]))
            nll = out.nll.double().cpu()
            for row, w in zip(nll, batch):
                # Target position p is row index p - start - 1.
                token_nll[w.first:w.end] += row[w.first - w.start - 1:]
                times[w.first:w.end] += 1
                context[w.first:w.end] = torch.arange(w.first - w.start, w.end - w.start)
            bar.update(len(batch))
    token_nll, times, context = (shard.sum(t, scorer.device) for t in (token_nll, times, context))
    token_nll[times == 0] = float("nan")
    return StreamScore(token_nll, times, context, len(windows))


def check_context_length(scorer: Scorer, context_length: int) -> None:
    limit = scorer.max_positions
    if limit is not None and context_length > limit:
        raise InputError(f"context_length {context_length} is longer than the model's {limit} positions; "
                         f"pass --context-length {limit} or less")
