"""Reductions the evaluations need across tensor- and data-parallel ranks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist

from models.parallel import get_parallel_state
from pipeline.families.common import vocab_parallel_argmax  # model-side: the GPT's scorer uses it

__all__ = ["DataShard", "vocab_parallel_argmax"]

T = TypeVar("T")


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
