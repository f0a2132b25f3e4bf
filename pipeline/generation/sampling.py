"""Choosing the next token from full-vocabulary logits: greedy, or sampled with temperature, top-k and top-p
(in that order, as ``transformers``' logits processors apply them) from the caller's own ``torch.Generator``,
so that sampling never draws from the global RNG streams (a run that samples trains as one that does not)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.job.errors import InputError


@dataclass(frozen=True)
class SampleSettings:
    max_new_tokens: int = 64
    greedy: bool = True
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def check(self) -> "SampleSettings":
        if self.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise InputError(f"--temperature must be > 0, got {self.temperature}; use --greedy for argmax decoding")
        if self.top_k is not None and self.top_k < 1:
            raise InputError(f"--top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InputError(f"--top-p must be in (0, 1], got {self.top_p}")
        return self

    def to_dict(self) -> dict:
        return dict(vars(self))


def next_tokens(logits: torch.Tensor, settings: SampleSettings, generator: torch.Generator | None) -> torch.Tensor:
    """[b] token ids from fp32 logits [b, V]."""
    if settings.greedy:
        return logits.argmax(-1)
    scores = logits / settings.temperature
    if settings.top_k is not None and settings.top_k < scores.shape[-1]:
        kth = torch.topk(scores, settings.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if settings.top_p is not None and settings.top_p < 1:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - settings.top_p
        drop[:, -1] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)
