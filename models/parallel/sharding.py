"""How a tensor-parallel parameter is cut from its full (TP=1) tensor, and put back.

Every sharded parameter carries a ``ShardSpec``: the dimension it is split
along and the *parts* it is made of along that dimension (a fused QKV weight
has three parts, a fused gate/up weight two, a vocabulary one, padded).
Each part is split evenly across the ranks, and a rank's shard is the
concatenation of its chunk of every part. Knowing this one rule is enough to
gather a full weight for a test or an export, and to re-shard a checkpoint to
another tensor-parallel size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .state import tp_group, tp_world_size


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by {denominator}")
    return numerator // denominator


def padded_size(size: int, tp: int, multiple: int = 1) -> int:
    """``size`` rounded up to a multiple of ``multiple * tp`` (Megatron's vocabulary padding)."""
    unit = multiple * tp
    return int(math.ceil(size / unit) * unit)


@dataclass(frozen=True)
class ShardSpec:
    dim: int                     # dimension split across ranks
    parts: tuple[int, ...]       # unpadded full sizes of the fused parts along ``dim``
    pad_multiple: int = 0        # 0: parts must divide evenly; k: pad each part to a multiple of k*tp

    def padded_part(self, part: int, tp: int) -> int:
        if self.pad_multiple:
            return padded_size(part, tp, self.pad_multiple)
        divide(part, tp, f"dimension {self.dim} part")
        return part

    def local_sizes(self, tp: int) -> list[int]:
        return [self.padded_part(p, tp) // tp for p in self.parts]

    def shard(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """This rank's shard of the full (unpadded) tensor."""
        if full.shape[self.dim] != sum(self.parts):
            raise ValueError(f"full tensor has {full.shape[self.dim]} along dim {self.dim}, "
                             f"expected {sum(self.parts)} (parts {self.parts})")
        pieces = []
        for part in full.split(list(self.parts), dim=self.dim):
            padded = self.padded_part(part.shape[self.dim], tp)
            if padded > part.shape[self.dim]:
                pad_shape = list(part.shape)
                pad_shape[self.dim] = padded - part.shape[self.dim]
                part = torch.cat([part, part.new_zeros(pad_shape)], dim=self.dim)
            pieces.append(part.chunk(tp, dim=self.dim)[rank])
        return torch.cat(pieces, dim=self.dim).contiguous()

    def gather(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full (unpadded) tensor from the shards of all ranks, in rank order."""
        tp = len(shards)
        local = self.local_sizes(tp)
        per_rank = [s.split(local, dim=self.dim) for s in shards]
        parts = []
        for i, size in enumerate(self.parts):
            joined = torch.cat([r[i] for r in per_rank], dim=self.dim)
            parts.append(joined.narrow(self.dim, 0, size))
        return torch.cat(parts, dim=self.dim)


def set_shard_spec(param: torch.nn.Parameter, spec: ShardSpec) -> None:
    # DeepSpeed counts a parameter with ``tensor_model_parallel`` once per TP rank in the global
    # gradient norm; every other parameter only on TP rank 0.
    param.tensor_model_parallel = True
    param.partition_dim = spec.dim
    param.shard_spec = spec


def mark_sequence_parallel(param: torch.nn.Parameter) -> None:
    """A replicated parameter applied to sequence-split activations (norms, row-parallel biases): it has no
    ShardSpec, so checkpoints, resharding and export treat it as replicated, and its forward goes through
    ``sequence_parallel_parameter`` so that its gradient is the sum over the TP ranks (identical on each)."""
    param.sequence_parallel = True


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "sequence_parallel", False))


def get_shard_spec(param: torch.Tensor) -> ShardSpec | None:
    return getattr(param, "shard_spec", None)


def gather_full(tensor: torch.Tensor, spec: ShardSpec | None) -> torch.Tensor:
    """All-gather a TP-sharded tensor (a parameter or its gradient) into its full form on every TP rank."""
    tp = tp_world_size()
    if spec is None or tp == 1:
        return tensor if spec is None else spec.gather([tensor])
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(shards, tensor.contiguous(), group=tp_group())
    return spec.gather(shards)


def full_state_dict(module: torch.nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) of ``module`` in full TP=1 form; collective over the TP group."""
    out = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        out[name] = gather_full(t.detach(), get_shard_spec(p)).cpu()
    return out
