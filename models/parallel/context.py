"""Context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): C ranks hold C contiguous chunks of each sequence.

Everything outside attention is per token, so each rank runs it on its own chunk. Attention goes through
DeepSpeed's ``DistributedAttention``: an all-to-all turns the chunk's [b, s/C, heads] queries, keys and values
into [b, s, heads/C] (every position, 1/C of the heads), the causal attention core runs on them as in one
process, and a second all-to-all turns the result back. No collective of this module is an all-to-all.

Grouped-query attention with fewer KV heads (on this TP rank) than C: the KV heads are replicated, each
``lcm(kv, C) / kv`` times (``repeat_interleave``, so query head i still reads KV head i // group), before the
all-to-all; DeepSpeed's even path then gives every rank whole KV groups, and the replicas' gradients are
summed back by autograd. (DeepSpeed's own uneven path refuses fewer KV heads than C.)

The loss: each rank sums its tokens' losses and divides by the token count of the whole sequence (a count
all-reduced over the context group); ``reduce_from_context_parallel_region`` adds the C partial losses in the
forward and passes the gradient through unchanged, so every rank logs the single-process loss and its
backward gives the gradient of its own tokens. DeepSpeed's engine and ZeRO sum those over the context group and
average over data parallelism (they divide by data x context / context), which is the single-process gradient.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from deepspeed.sequence.layer import DistributedAttention
from torch import nn

from .state import cp_group, cp_rank, cp_world_size


def context_chunk(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (the sequence); ``x`` itself without context
    parallelism. No gradient flows through it (token ids and labels)."""
    c = cp_world_size()
    if x.shape[dim] % c:
        raise ValueError(f"sequence length {x.shape[dim]} (dimension {dim}) is not divisible by context-parallel "
                         f"size {c}")
    return x.chunk(c, dim=dim)[cp_rank()] if c > 1 else x


def chunk_start(local_len: int) -> int:
    """The global position of this rank's first token, for a chunk of ``local_len`` tokens."""
    return cp_rank() * local_len


def _gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(cp_world_size())]
    dist.all_gather(parts, x, group=cp_group())
    return torch.cat(parts, dim=dim)


class _GatherFromContextParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        return _gather(x, dim)

    @staticmethod
    def backward(ctx, grad):
        # the consumer of the gathered tensor is replicated over the context group: each rank keeps its chunk
        return grad.chunk(cp_world_size(), dim=ctx.dim)[cp_rank()].contiguous(), None


class _ReduceFromContextParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x, group=cp_group())
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_gradient(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` in the forward, its gradient times ``scale`` in the backward (DeepSpeed sums gradients over data x
    context: a replicated consumer's, or a loss that a D x C average reduces, needs a 1 / C or C there)."""
    return x if scale == 1 else _ScaleGradient.apply(x, float(scale))


def gather_from_context_parallel_region(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The whole sequence from the chunks (all-gather along ``dim``); the backward keeps this rank's chunk."""
    if cp_world_size() == 1:
        return x
    return _GatherFromContextParallelRegion.apply(x, dim)


def reduce_from_context_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """The sum over the context group in the forward; the gradient passes through unchanged."""
    if cp_world_size() == 1:
        return x
    return _ReduceFromContextParallelRegion.apply(x)


def global_count(mask: torch.Tensor) -> torch.Tensor:
    """The number of true entries of ``mask`` over the whole sequence (summed over the context group)."""
    n = mask.sum()
    if cp_world_size() > 1:
        n = n.clone()
        dist.all_reduce(n, group=cp_group())
    return n


def kv_replicas(local_kv_heads: int, context_parallel: int) -> int:
    """How many times each KV head is repeated so that the context group splits whole KV groups."""
    return math.lcm(local_kv_heads, context_parallel) // local_kv_heads


class UlyssesAttention(nn.Module):
    """``core(q, k, v)`` ([b, heads, s, d] each, the whole sequence) run over the context group through
    DeepSpeed's ``DistributedAttention``; takes and returns this rank's chunk, [b, heads, s/C, d] in,
    [b, s/C, heads, d] out."""

    def __init__(self, core, local_heads: int, local_kv_heads: int):
        super().__init__()
        c = cp_world_size()
        if local_heads % c:
            raise ValueError(f"{local_heads} attention heads per tensor-parallel rank are not divisible by the "
                             f"context-parallel size {c}")
        self.replicas = kv_replicas(local_kv_heads, c)
        if local_heads % (local_kv_heads * self.replicas):
            raise ValueError(f"{local_kv_heads} KV heads per tensor-parallel rank, replicated to "
                             f"{local_kv_heads * self.replicas} for context-parallel size {c}, do not divide the "
                             f"{local_heads} query heads")
        self.core = core
        self.attention = DistributedAttention(self._local, cp_group(), scatter_idx=2, gather_idx=1,
                                              num_kv_heads=local_kv_heads * self.replicas)

    def _local(self, q, k, v):  # [b, s, heads/C, d] -> the core on [b, heads/C, s, d] -> [b, s, heads/C, d]
        return self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.replicas > 1:
            k, v = k.repeat_interleave(self.replicas, dim=1), v.repeat_interleave(self.replicas, dim=1)
        return self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)
