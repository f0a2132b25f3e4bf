"""Tensor-parallel layers: column- and row-parallel linears, vocab-parallel embedding.

Weights are initialised as the full (master) tensor from the default RNG,
identically on every rank, and each rank keeps its slice: a model built at
TP=2 starts from exactly the weights of the same model at TP=1.

With ``sequence_parallel`` the layers take and give activations split along
the sequence (dimension ``sequence_dim``, 1 in a [batch, seq, ...] layout)
instead of replicated ones: column-parallel all-gathers its input, row-parallel
and the embedding reduce-scatter their outputs.

A linear's ``fp8`` (None: the run's precision; set by ``models.parallel.fp8.enable_fp8``) computes its local
matmul in FP8; the collectives around it stay as they are, in the run's precision.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .mappings import (copy_to_tensor_parallel_region, gather_along, gather_from_sequence_parallel_region,
                       gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region, reduce_scatter_along,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_parallel_region,
                       sequence_parallel_parameter)
from .sharding import ShardSpec, divide, mark_sequence_parallel, set_shard_spec
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


class _SequenceGatherLinear(torch.autograd.Function):
    """Y = all_gather_seq(X) A^T + b. Only the local chunk of X is kept for the backward, which gathers it
    again for the weight gradient (the paper's saving: the gathered input is never stored), and
    reduce-scatters the input gradient (each rank's is a partial sum over its output columns)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dim):
        ctx.dim, ctx.has_bias = dim, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(gather_along(x, dim), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = reduce_scatter_along(grad.matmul(weight), ctx.dim)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            full = gather_along(x, ctx.dim)
            grad_w = flat_grad.t().matmul(full.reshape(-1, full.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat_grad.sum(0)
        return grad_x, grad_w, grad_b, None


def sequence_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           dim: int = 1) -> torch.Tensor:
    """A column-parallel matmul on sequence-split input (``x`` this rank's chunk of dimension ``dim``)."""
    return _SequenceGatherLinear.apply(x, weight, bias, dim)


def local_linear(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x A^T (+ bias) with this rank's shard A = ``module.weight``: in FP8 when ``module.fp8`` is set (the bias
    then added in the output's precision, as torchao's Float8Linear does)."""
    if module.fp8 is None:
        return F.linear(x, module.weight, bias)
    y = module.fp8(x, module.weight)
    return y if bias is None else y + bias.to(y.dtype)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns (output features) across TP ranks.

    ``output_sizes`` fuses several outputs into one matrix product (QKV, gate/up):
    each is split across the ranks on its own, so a rank holds its slice of each.
    With ``gather_output`` the full output is all-gathered; otherwise the output
    stays split, ready for a ``RowParallelLinear`` with ``input_is_parallel``.
    With ``sequence_parallel`` the input is this rank's sequence chunk: it is
    all-gathered (the output covers the whole sequence, split by columns).
    """

    def __init__(self, in_features: int, out_features: int | None = None, *, output_sizes: Sequence[int] | None = None,
                 bias: bool = True, gather_output: bool = False, init_method: InitMethod = normal_init(0.02),
                 sequence_parallel: bool = False, sequence_dim: int = 1, dtype=None, device=None):
        super().__init__()
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output and sequence_parallel exclude each other "
                             "(a sequence-parallel output feeds a RowParallelLinear)")
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
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
        self.fp8 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and tp_world_size() > 1:
            if self.fp8 is None:
                return sequence_gather_linear(x, self.weight, self.bias, self.sequence_dim)
            # FP8: the gather as its own op (its backward a reduce-scatter), the gathered input kept for the backward
            return local_linear(self, gather_from_sequence_parallel_region(x, self.sequence_dim), self.bias)
        y = local_linear(self, copy_to_tensor_parallel_region(x), self.bias)
        return gather_from_tensor_parallel_region(y) if self.gather_output else y

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.output_sizes}, local_out={self.local_output_sizes}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows (input features); partial products are all-reduced.

    The bias is added once, after the reduction. With ``sequence_parallel`` the
    partial products are reduce-scattered along the sequence instead: each rank
    gets its chunk of the sum, and the bias (replicated, applied to that chunk
    only) is marked sequence-parallel so that its gradient is summed over TP.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, input_is_parallel: bool = False,
                 init_method: InitMethod = normal_init(0.02), sequence_parallel: bool = False, sequence_dim: int = 1,
                 dtype=None, device=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel (its input is the "
                             "column-split output of a ColumnParallelLinear)")
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        divide(in_features, tp_world_size(), "RowParallelLinear input size")
        spec = ShardSpec(dim=1, parts=(in_features,))
        self.weight = sharded_parameter((out_features, in_features), spec, init_method, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype or torch.get_default_dtype()))
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)
        self.fp8 = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(local_linear(self, x, None), self.sequence_dim)
            return y + sequence_parallel_parameter(self.bias) if self.bias is not None else y
        y = reduce_from_tensor_parallel_region(local_linear(self, x, None))
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across TP ranks.

    The vocabulary is padded to a multiple of ``pad_multiple * tp`` (Megatron pads to
    128 x TP for fast kernels); padding rows start at zero and are never looked up.
    Each rank embeds the ids in its range, zeros the rest, and the partial
    embeddings are summed across ranks; with ``sequence_parallel`` they are
    reduce-scattered, each rank keeping its chunk of the sequence.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, pad_multiple: int = 128,
                 init_method: InitMethod = normal_init(0.02), sequence_parallel: bool = False, sequence_dim: int = 1,
                 dtype=None, device=None):
        super().__init__()
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
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
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.sequence_dim)
        return reduce_from_tensor_parallel_region(out)

    def extra_repr(self):
        return (f"vocab={self.num_embeddings} (padded {self.padded_num_embeddings}), dim={self.embedding_dim}, "
                f"rows=[{self.vocab_start}, {self.vocab_end})")
