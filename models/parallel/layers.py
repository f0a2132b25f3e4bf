"""Tensor-parallel layers: column- and row-parallel linears, vocab-parallel embedding.

Weights are initialised as the full (master) tensor from the default RNG,
identically on every rank, and each rank keeps its slice: a model built at
TP=2 starts from exactly the weights of the same model at TP=1.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .mappings import (copy_to_tensor_parallel_region, gather_from_tensor_parallel_region,
                       reduce_from_tensor_parallel_region, scatter_to_tensor_parallel_region)
from .sharding import ShardSpec, divide, set_shard_spec
from .state import tp_rank, tp_world_size

InitMethod = Callable[[torch.Tensor], torch.Tensor]


def normal_init(std: float) -> InitMethod:
    return lambda t: nn.init.normal_(t, mean=0.0, std=std)


def sharded_parameter(full_shape, spec: ShardSpec, init_method: InitMethod, dtype, device) -> nn.Parameter:
    # The master weight is drawn on the CPU in fp32 so that the draw is the same whatever the
    # TP size, device or dtype; then this rank's shard is kept.
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    shard = spec.shard(master, tp_rank(), tp_world_size())
    param = nn.Parameter(shard.to(device=device, dtype=dtype or torch.get_default_dtype()))
    set_shard_spec(param, spec)
    return param


def vocab_parallel_parameter(vocab_size: int, dim: int, pad_multiple: int = 128,
                             init_method: InitMethod = normal_init(0.02), dtype=None, device=None) -> nn.Parameter:
    """A [vocab, dim] weight split by vocabulary rows, padded to a multiple of ``pad_multiple * tp``."""
    spec = ShardSpec(dim=0, parts=(vocab_size,), pad_multiple=pad_multiple)
    return sharded_parameter((vocab_size, dim), spec, init_method, dtype, device)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) across TP ranks.

    ``output_sizes`` fuses several outputs into one matrix product (QKV, gate/up):
    each is split across the ranks on its own, so a rank holds its slice of each.
    With ``gather_output`` the full output is all-gathered; otherwise the output
    stays split, ready for a ``RowParallelLinear`` with ``input_is_parallel``.
    """

    def __init__(self, in_features: int, out_features: int | None = None, *, output_sizes: Sequence[int] | None = None,
                 bias: bool = True, gather_output: bool = False, init_method: InitMethod = normal_init(0.02),
                 dtype=None, device=None):
        super().__init__()
        if output_sizes is None:
            if out_features is None:
                raise ValueError("ColumnParallelLinear needs out_features or output_sizes")
            output_sizes = (out_features,)
        self.output_sizes = tuple(int(s) for s in output_sizes)
        self.in_features = in_features
        self.out_features = sum(self.output_sizes)
        self.gather_output = gather_output
        tp = tp_world_size()
        for s in self.output_sizes:
            divide(s, tp, "ColumnParallelLinear output size")
        self.local_output_sizes = [s // tp for s in self.output_sizes]
        spec = ShardSpec(dim=0, parts=self.output_sizes)
        self.weight = sharded_parameter((self.out_features, in_features), spec, init_method, dtype, device)
        if bias:
            self.bias = sharded_parameter((self.out_features,), spec, nn.init.zeros_, dtype, device)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tensor_parallel_region(x), self.weight, self.bias)
        return gather_from_tensor_parallel_region(y) if self.gather_output else y

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.output_sizes}, local_out={self.local_output_sizes}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features); partial products are all-reduced.

    The bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, input_is_parallel: bool = False,
                 init_method: InitMethod = normal_init(0.02), dtype=None, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        divide(in_features, tp_world_size(), "RowParallelLinear input size")
        spec = ShardSpec(dim=1, parts=(in_features,))
        self.weight = sharded_parameter((out_features, in_features), spec, init_method, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype or torch.get_default_dtype()))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x)
        y = reduce_from_tensor_parallel_region(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across TP ranks.

    The vocabulary is padded to a multiple of ``pad_multiple * tp`` (Megatron pads to
    128 x TP for fast kernels); padding rows start at zero and are never looked up.
    Each rank embeds the ids in its range, zeros the rest, and the partial
    embeddings are summed across ranks.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, pad_multiple: int = 128,
                 init_method: InitMethod = normal_init(0.02), dtype=None, device=None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = vocab_parallel_parameter(num_embeddings, embedding_dim, pad_multiple, init_method, dtype, device)
        self.padded_num_embeddings = self.weight.shape[0] * tp_world_size()
        self.vocab_start = tp_rank() * self.weight.shape[0]
        self.vocab_end = self.vocab_start + self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_world_size() == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out)

    def extra_repr(self):
        return (f"vocab={self.num_embeddings} (padded {self.padded_num_embeddings}), dim={self.embedding_dim}, "
                f"rows=[{self.vocab_start}, {self.vocab_end})")
