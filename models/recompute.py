"""Output-discarding recomputation of a cheap op whose output only one matmul reads (Megatron-Core's
``CheckpointWithoutOutput``, used there for the ``layernorm`` and ``moe_act`` recompute modules).

A plain checkpoint around such an op saves nothing: it keeps the op's input, and the matmul after it keeps the
op's output as its own input. Here the op runs outside autograd's record (only its input is saved), the matmul
saves the output as usual, and ``discard`` then frees that output's storage; a hook on the matmul's output
gradient recomputes the op and refills the storage before the matmul's backward reads it. The ops recomputed
this way (norms, GELU, SwiGLU) draw no random numbers, so no RNG state has to be restored: the dropouts of the
layer lie outside them (core attention, which has one, goes through DeepSpeed's checkpoint instead).

In a compiled region (``--compile``) neither DeepSpeed's checkpoint nor the storage swap here can be traced:
``compiled_recompute`` puts the op under torch's non-reentrant checkpoint instead, which Dynamo traces into the
block's graph and whose recomputation the compiler's partitioner plans (a random draw inside, the dropout mask of
``models.parallel.dropout_from``, is saved, not drawn again).
"""
from __future__ import annotations

import torch
import torch.utils.checkpoint


def compiled_recompute(fn, *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)`` recomputed in the backward of a compiled graph (torch's non-reentrant checkpoint)."""
    return torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False)


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, holder, *inputs):
        ctx.holder = holder
        ctx.save_for_backward(*inputs)
        holder.ctx = ctx
        with torch.no_grad():
            return holder.fn(*inputs)

    @staticmethod
    def backward(ctx, grad):
        inputs, output = ctx.holder.recomputed
        ctx.holder.recomputed = None
        torch.autograd.backward(output, grad)
        return (None,) + tuple(t.grad if t.requires_grad else None for t in inputs)


class DiscardedOutput:
    """``fn(*inputs)`` (one tensor out) as ``.output``, its storage freed by ``discard(consumer_output)`` once
    the consumer has saved it, and rebuilt when the consumer's output gradient arrives."""

    def __init__(self, fn, *inputs: torch.Tensor):
        self.fn, self.ctx, self.recomputed = fn, None, None
        self.output = _Recomputed.apply(self, *inputs)

    def discard(self, consumer_output: torch.Tensor) -> None:
        if not consumer_output.requires_grad:  # no backward will read it
            return
        self.output.untyped_storage().resize_(0)
        consumer_output.register_hook(self._recompute)

    def _recompute(self, grad):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in self.ctx.saved_tensors]
        with torch.enable_grad():
            output = self.fn(*inputs)
        storage = self.output.untyped_storage()
        storage.resize_(output.untyped_storage().nbytes())
        with torch.no_grad():
            storage.copy_(output.untyped_storage())
        self.recomputed = inputs, output
