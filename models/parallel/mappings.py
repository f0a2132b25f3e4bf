"""The conjugate communication ops of Megatron-LM (2019), and those of its sequence parallelism (2022).

``copy_to_tensor_parallel_region`` is the paper's *f* (identity forward,
all-reduce backward) and ``reduce_from_tensor_parallel_region`` its *g*
(all-reduce forward, identity backward). Scatter/gather split or join the
last dimension across the tensor-parallel ranks.

Sequence parallelism replaces *f* by an all-gather along the sequence (its
backward a reduce-scatter) and *g* by a reduce-scatter (its backward an
all-gather): same communication volume, activations split by TP in between.

Every collective here is also a ``torch.library`` custom op (``mds::tp_*``, ``mds::all_reduce``), which is what a
compiled region calls: one opaque node to Dynamo, so a ``torch.compile``d block traces whole (DeepSpeed's comms
logger, which times each call with ``time.time`` and broke the graph 13-30 times per block, runs inside the op at
run time and still counts the call). Eager code calls the same functions directly, in place where it was.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives
from .state import cp_group, tp_group, tp_rank, tp_world_size


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_world_size() == 1:
        return x
    if torch.compiler.is_compiling():
        return group_all_reduce(x)
    return collectives.all_reduce(x.contiguous(), tp_group())


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
_GROUPS = {"tp": tp_group, "cp": cp_group}


@torch.library.custom_op("mds::all_reduce", mutates_args=())
def group_all_reduce(x: torch.Tensor, op: str = "sum", group: str = "tp") -> torch.Tensor:
    """Reduce (``op`` sum or max) over the tensor- or context-parallel group (``group`` "tp" or "cp") into a new
    tensor (a custom op may not alias its input)."""
    return collectives.all_reduce(x.clone(memory_format=torch.contiguous_format), _GROUPS[group](),
                                  op=_REDUCE_OPS[op], name=group)


@group_all_reduce.register_fake
def _(x, op="sum", group="tp"):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def all_reduce_max(x: torch.Tensor, group: str = "tp") -> torch.Tensor:
    """The elementwise max over the TP or CP group (a new tensor; no autograd: for scales)."""
    return group_all_reduce(x, "max", group)


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = tp_world_size()
    if world == 1:
        return x
    if x.shape[-1] % world:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by tensor-parallel size {world}")
    return x.chunk(world, dim=-1)[tp_rank()].contiguous()


def _gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if tp_world_size() == 1:
        return x
    return gather_along(x, x.dim() - 1) if torch.compiler.is_compiling() else _gather_list(x)


def _gather_list(x: torch.Tensor) -> torch.Tensor:
    world = tp_world_size()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    collectives.all_gather_list(parts, x, tp_group())
    return torch.cat(parts, dim=-1)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        # In place, as Megatron does: x is a fresh matmul output that nothing else holds.
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad)


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


def copy_to_tensor_parallel_region(x):
    return _CopyToTensorParallelRegion.apply(x)


def reduce_from_tensor_parallel_region(x):
    return _ReduceFromTensorParallelRegion.apply(x)


def scatter_to_tensor_parallel_region(x):
    return _ScatterToTensorParallelRegion.apply(x)


def gather_from_tensor_parallel_region(x):
    return _GatherFromTensorParallelRegion.apply(x)


# -- sequence parallelism (Korthikanti et al. 2022) ----------------------------------------------------------------
# Between the tensor-parallel matmuls the activations are split along the sequence: rank r holds the r-th of
# tp equal chunks of dimension ``dim``. Entering a column-parallel matmul the chunks are all-gathered (and the
# input gradient, a partial sum on each rank, is reduce-scattered); leaving a row-parallel one the partial
# outputs are reduce-scattered instead of all-reduced (and the gradient all-gathered).

def _sequence_chunk(x: torch.Tensor, dim: int) -> torch.Tensor:
    world = tp_world_size()
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"sequence length {x.shape[dim]} (dimension {dim}) is not divisible by tensor-parallel "
                         f"size {world}: sequence parallelism splits it into {world} equal chunks")
    return x.chunk(world, dim=dim)[tp_rank()].contiguous()


def gather_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """All-gather the TP ranks' chunks of dimension ``dim``, in rank order (no autograd)."""
    if tp_world_size() == 1:
        return x
    return tp_gather_along(x, dim) if torch.compiler.is_compiling() else _gather_along(x, dim)


def _gather_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    world = tp_world_size()
    local = x.movedim(dim, 0).contiguous()  # the collective joins along the leading dimension
    out = local.new_empty((world * local.shape[0], *local.shape[1:]))
    collectives.all_gather_into(out, local, tp_group())
    return out.movedim(0, dim).contiguous()


def reduce_scatter_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over the TP ranks, each keeping its chunk of dimension ``dim`` (no autograd)."""
    world = tp_world_size()
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"sequence length {x.shape[dim]} (dimension {dim}) is not divisible by tensor-parallel "
                         f"size {world}")
    return tp_reduce_scatter_along(x, dim) if torch.compiler.is_compiling() else _reduce_scatter_along(x, dim)


def _reduce_scatter_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    world = tp_world_size()
    full = x.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // world, *full.shape[1:]))
    collectives.reduce_scatter_into(out, full, tp_group())
    return out.movedim(0, dim).contiguous()


@torch.library.custom_op("mds::tp_gather_along", mutates_args=())
def tp_gather_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _gather_along(x, dim)


def _with_size(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """An empty tensor shaped as ``x`` but for dimension ``dim`` (what a fake collective returns)."""
    return x.new_empty((*x.shape[:dim], size, *x.shape[dim:][1:]))


@tp_gather_along.register_fake
def _(x, dim):
    return _with_size(x, dim, x.shape[dim] * tp_world_size())


@torch.library.custom_op("mds::tp_reduce_scatter_along", mutates_args=())
def tp_reduce_scatter_along(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _reduce_scatter_along(x, dim)


@tp_reduce_scatter_along.register_fake
def _(x, dim):
    return _with_size(x, dim, x.shape[dim] // tp_world_size())


def all_reduce_fp32(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group, accumulated in fp32 whatever the dtype (a new tensor)."""
    if tp_world_size() == 1:
        return x
    if torch.compiler.is_compiling():
        return group_all_reduce(x.float()).to(x.dtype)
    acc = x.float().contiguous() if x.dtype != torch.float32 else x.clone(memory_format=torch.contiguous_format)
    collectives.all_reduce(acc, tp_group())
    return acc.to(x.dtype)


class _ToSequenceParallelRegion(torch.autograd.Function):
    """Into the sequence-split region: this rank's chunk of a replicated tensor (``reduce`` false) or of the
    sum of the ranks' partial tensors (``reduce`` true: a reduce-scatter). Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, dim, reduce):
        ctx.dim = dim
        return reduce_scatter_along(x, dim) if reduce else _sequence_chunk(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return gather_along(grad, ctx.dim), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, partial_grad):
        ctx.dim, ctx.partial_grad = dim, partial_grad
        return gather_along(x, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial_grad:  # a tensor-parallel consumer: each rank holds a partial sum of the gradient
            return reduce_scatter_along(grad, ctx.dim), None, None
        return _sequence_chunk(grad, ctx.dim), None, None  # a replicated consumer: the gradient is whole


class _SequenceParallelParameter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, param):
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_fp32(grad)


def scatter_to_sequence_parallel_region(x, dim: int = 1):
    """Keep this rank's chunk of dimension ``dim`` (a replicated tensor enters the sequence-split region);
    backward: all-gather."""
    return _ToSequenceParallelRegion.apply(x, dim, False)


def gather_from_sequence_parallel_region(x, dim: int = 1, tensor_parallel_output_grad: bool = True):
    """All-gather the chunks of dimension ``dim``. Backward: reduce-scatter when the consumer is
    tensor-parallel (its input gradient is a partial sum per rank), else keep this rank's chunk."""
    return _GatherFromSequenceParallelRegion.apply(x, dim, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x, dim: int = 1):
    """Sum the partial results of the TP ranks, each keeping its chunk of dimension ``dim``; backward: all-gather."""
    return _ToSequenceParallelRegion.apply(x, dim, True)


def sequence_parallel_parameter(param):
    """A replicated parameter applied to sequence-split activations: identity forward; backward sums its
    gradient (from this rank's chunk only) over the TP group, in fp32, before autograd accumulates it. The
    sum is part of the graph, so it holds under any ZeRO stage, pipeline stage and activation checkpointing."""
    if tp_world_size() == 1:
        return param
    return _SequenceParallelParameter.apply(param)
