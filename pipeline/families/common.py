"""What the families' parts share: the scores a scorer returns, its base, the vocabulary-parallel argmax, and the
layer depths of an encoder (for layer-wise learning-rate decay)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.parallel import tp_group, tp_rank, tp_world_size


@dataclass
class TokenScores:
    nll: torch.Tensor                   # [b, s-1] float32
    greedy: torch.Tensor | None = None  # [b, s-1] int64


def vocab_parallel_argmax(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Index of the largest logit over the whole vocabulary, from this rank's vocabulary slice.

    ``local_logits`` [..., V/tp] are the columns ``[rank * V/tp, (rank + 1) * V/tp)``
    of the padded vocabulary (as ``GPT.parallel_logits`` gives them). Padding
    columns (>= ``vocab_size``) are never chosen. Ties go to the lowest index,
    as ``torch.argmax`` does at TP=1, so every TP size picks the same token.
    Two scalar reductions per position over the tensor-parallel group; the
    logits themselves are never gathered.
    """
    local_v = local_logits.shape[-1]
    start = tp_rank() * local_v
    x = local_logits.float()
    if start + local_v > vocab_size:  # this shard holds padding columns
        pad = torch.arange(start, start + local_v, device=x.device) >= vocab_size
        x = x.masked_fill(pad, float("-inf"))
    local_idx = x.argmax(-1)
    local_max = x.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1)
    index = local_idx + start
    if tp_world_size() == 1:
        return index
    global_max = local_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group())
    # Among the ranks holding the maximum, the lowest global index wins.
    index = torch.where(local_max == global_max, index, torch.full_like(index, torch.iinfo(index.dtype).max))
    dist.all_reduce(index, op=dist.ReduceOp.MIN, group=tp_group())
    return index


class ProjectScorer:
    """A project model (``model.config.vocab_size``) that reads at most ``max_positions`` tokens."""

    def __init__(self, model, max_positions: int):
        self.model = model.eval()
        self.vocab_size = model.config.vocab_size
        self.max_positions = max_positions
        self.device = next(model.parameters()).device


class LayerDepths:
    """Depths for layer-wise learning-rate decay of a model of ``embedding``, ``layers.<i>`` and output parts."""

    @property
    def num_depths(self) -> int:
        return self.config.num_layers + 2

    def depth_of(self, name: str) -> int:
        """embedding 0, layers.i -> i + 1, what follows the layers (final norm, output layer) L + 1."""
        if name.startswith("embedding."):
            return 0
        m = re.match(r"layers\.(\d+)\.", name)
        return int(m.group(1)) + 1 if m else self.config.num_layers + 1
