"""Reductions the evaluations need across tensor- and data-parallel ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist

from models.parallel import get_parallel_state, tp_group, tp_rank, tp_world_size

T = TypeVar("T")


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


@dataclass(frozen=True)
class DataShard:
    """This rank's share of the evaluation data, and the sum of every share.

    Ranks of one tensor-parallel group hold the same share (they compute one
    model together); data-parallel replicas take every ``size``-th item.
    """
    rank: int = 0
    size: int = 1
    group: Any = None

    @classmethod
    def current(cls) -> "DataShard":
        """The data-parallel coordinates of this process (a single share without torch.distributed)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        state = get_parallel_state()
        return cls(state.get_data_parallel_rank(), state.get_data_parallel_world_size(),
                   state.get_data_parallel_group())

    def take(self, items: Sequence[T]) -> Sequence[T]:
        return items[self.rank::self.size]

    def sum(self, tensor: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """Elementwise sum over the data-parallel replicas (collective: every replica calls it)."""
        if self.size == 1:
            return tensor
        t = tensor.to(device)
        dist.all_reduce(t, group=self.group)
        return t.to(tensor.device)
