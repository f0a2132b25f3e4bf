"""The conjugate communication ops of Megatron-LM (2019), as autograd functions.

``copy_to_tensor_parallel_region`` is the paper's *f* (identity forward,
all-reduce backward) and ``reduce_from_tensor_parallel_region`` its *g*
(all-reduce forward, identity backward). Scatter/gather split or join the
last dimension across the tensor-parallel ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .state import tp_group, tp_rank, tp_world_size


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_world_size() == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=tp_group())
    return x


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = tp_world_size()
    if world == 1:
        return x
    if x.shape[-1] % world:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by tensor-parallel size {world}")
    return x.chunk(world, dim=-1)[tp_rank()].contiguous()


def _gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = tp_world_size()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=tp_group())
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
