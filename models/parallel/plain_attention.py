"""Causal attention as plain matrix products, in fp32: what a CPU runs for short sequences (faster there than
PyTorch's flash kernel, ``models.gpt.SHORT_CPU_ATTENTION``), and what a compiled block holds for SDPA's math path
with dropout (``models.parallel.random.causal_attention_from``)."""
from __future__ import annotations

import math

import torch


def short_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kept: torch.Tensor | None = None,
                           p: float = 0.0) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v of [b, heads, s, d] tensors (k, v: [b, kv_heads, s, d], grouped-
    query heads broadcast, not copied), computed in fp32 and returned in q's dtype: SDPA's result to its
    rounding. ``kept`` [b, heads, s, s]: the probabilities a dropout of ``p`` keeps (scaled by 1 / (1 - p))."""
    b, h, s, d = q.shape
    kv = k.shape[1]
    q5, k5, v5 = q.reshape(b, kv, h // kv, s, d).float(), k[:, :, None].float(), v[:, :, None].float()
    scores = (q5 @ k5.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    if kept is not None:
        probs = probs * kept.reshape(probs.shape) / (1 - p)
    return (probs @ v5).to(q.dtype).reshape(b, h, s, d)
