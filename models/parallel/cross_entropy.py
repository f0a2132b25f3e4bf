"""Cross-entropy over vocabulary-parallel logits, never gathering the full logits.

Each rank holds the logits of its slice of the (padded) vocabulary. The max,
the sum of exponentials, the target logit and (for label smoothing) the sum of
logits are reduced across ranks as a few scalars per token, in fp32.
Padding columns (index >= ``vocab_size``) are excluded: never predicted, and
not counted in label smoothing.

With ``chunk_tokens`` the same loss is computed a chunk of tokens at a time: the fp32 work tensors are
[chunk_tokens, V/tp], never [tokens, V/tp]; the backward keeps the logits (in their own dtype) and two fp32
numbers per token and recomputes each chunk's softmax (``_ChunkedVocabParallelCrossEntropy``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import collectives
from .state import tp_group, tp_rank, tp_world_size


def _all_reduce(x, op=dist.ReduceOp.SUM):
    if tp_world_size() > 1:
        collectives.all_reduce(x, tp_group(), op=op)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, ignore_index, label_smoothing):
        local_v = logits.shape[-1]
        start = tp_rank() * local_v
        n_valid = max(0, min(local_v, vocab_size - start))  # padding columns are a suffix of the last shard
        # One full-size fp32 tensor is made (the cast of bf16/fp16 logits, else the shifted copy) and then
        # worked on in place: x - max, exp, / sum; it is the softmax saved for the backward.
        x = logits.float()
        owned = x is not logits
        if n_valid < local_v:
            x = x.index_fill_(-1, _suffix(n_valid, local_v, x.device), float("-inf")) if owned else \
                x.index_fill(-1, _suffix(n_valid, local_v, x.device), float("-inf"))
            owned = True

        x_max = _all_reduce(x.amax(dim=-1), dist.ReduceOp.MAX)
        x = x.sub_(x_max.unsqueeze(-1)) if owned else x - x_max.unsqueeze(-1)

        ignored = target == ignore_index
        local_t = target - start
        in_shard = (local_t >= 0) & (local_t < local_v) & ~ignored
        t_idx = local_t.masked_fill(~in_shard, 0)
        target_logit = x.gather(-1, t_idx.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)
        smooth_sum = x[..., :n_valid].sum(-1) if label_smoothing > 0 else None

        exp_x = x.exp_()
        sums = [exp_x.sum(-1), target_logit]
        if smooth_sum is not None:
            sums.append(smooth_sum)
        sums = _all_reduce(torch.stack(sums))  # one collective for all the per-token sums
        sum_exp, target_logit = sums[0], sums[1]
        log_z = sum_exp.log()
        loss = log_z - target_logit
        if label_smoothing > 0:
            mean_log_prob = sums[2] / vocab_size - log_z
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp_x.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, t_idx, in_shard, ignored)
        ctx.vocab_size = vocab_size
        ctx.n_valid = n_valid
        ctx.label_smoothing = label_smoothing
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, t_idx, in_shard, ignored = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # reused in place: d loss / d logit = softmax - (1-eps) onehot - eps/V
        grad.scatter_add_(-1, t_idx.unsqueeze(-1), -(1.0 - eps) * in_shard.to(grad.dtype).unsqueeze(-1))
        if eps > 0:
            grad[..., :ctx.n_valid].sub_(eps / ctx.vocab_size)  # padding columns: softmax 0, no smoothing
        grad.mul_((grad_loss.float() * (~ignored)).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def _suffix(n_valid: int, local_v: int, device) -> torch.Tensor:
    return torch.arange(n_valid, local_v, device=device)


def _fp32_chunk(chunk: torch.Tensor, n_valid: int) -> torch.Tensor:
    """The chunk's logits in fp32 (a new tensor), padding columns at -inf."""
    x = chunk.float()
    if n_valid < chunk.shape[-1]:
        return x.index_fill(-1, _suffix(n_valid, chunk.shape[-1], x.device), float("-inf"))
    return x if x is not chunk else x.clone()


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    """``_VocabParallelCrossEntropy``'s loss and gradient over [tokens, V/tp] logits, ``chunk`` tokens at a time:
    a first pass for the max, one all-reduce, a second for the sums, one all-reduce (the collectives of the
    unchunked one); the backward recomputes exp(x - max) / sum per chunk."""

    @staticmethod
    def forward(ctx, logits, target, vocab_size, ignore_index, label_smoothing, chunk):
        local_v = logits.shape[-1]
        start = tp_rank() * local_v
        n_valid = max(0, min(local_v, vocab_size - start))
        flat, t = logits.reshape(-1, local_v), target.reshape(-1)
        ignored = t == ignore_index
        local_t = t - start
        in_shard = (local_t >= 0) & (local_t < local_v) & ~ignored
        t_idx = local_t.masked_fill(~in_shard, 0)
        bounds = [(i, min(i + chunk, flat.shape[0])) for i in range(0, flat.shape[0], chunk)]
        x_max = _all_reduce(torch.cat([_fp32_chunk(flat[i:j], n_valid).amax(-1) for i, j in bounds]),
                            dist.ReduceOp.MAX)
        sums = []
        for i, j in bounds:
            x = _fp32_chunk(flat[i:j], n_valid).sub_(x_max[i:j, None])
            parts = [x.gather(-1, t_idx[i:j, None]).squeeze(-1).masked_fill(~in_shard[i:j], 0.0)]
            if label_smoothing > 0:
                parts.append(x[:, :n_valid].sum(-1))
            parts.insert(0, x.exp_().sum(-1))
            sums.append(torch.stack(parts))
        sums = _all_reduce(torch.cat(sums, dim=1))  # one collective for all the per-token sums
        sum_exp, target_logit = sums[0], sums[1]
        log_z = sum_exp.log()
        loss = log_z - target_logit
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss - label_smoothing * (sums[2] / vocab_size - log_z)
        ctx.save_for_backward(logits, x_max, sum_exp, t_idx, in_shard, ignored)
        ctx.vocab_size, ctx.n_valid, ctx.label_smoothing, ctx.bounds = vocab_size, n_valid, label_smoothing, bounds
        return loss.masked_fill(ignored, 0.0).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, x_max, sum_exp, t_idx, in_shard, ignored = ctx.saved_tensors
        eps, n_valid = ctx.label_smoothing, ctx.n_valid
        flat = logits.reshape(-1, logits.shape[-1])
        scale = grad_loss.reshape(-1).float() * ~ignored
        grad = torch.empty_like(flat)
        for i, j in ctx.bounds:
            g = _fp32_chunk(flat[i:j], n_valid).sub_(x_max[i:j, None]).exp_().div_(sum_exp[i:j, None])
            g.scatter_add_(-1, t_idx[i:j, None], -(1.0 - eps) * in_shard[i:j, None].to(g.dtype))
            if eps > 0:
                g[:, :n_valid].sub_(eps / ctx.vocab_size)
            grad[i:j] = g.mul_(scale[i:j, None])
        return grad.view(logits.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, vocab_size: int | None = None,
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 reduction: str = "mean", chunk_tokens: int | None = None) -> torch.Tensor:
    """Cross-entropy of ``logits`` (this rank's vocabulary slice, [..., V/tp]) against ``target`` [...].

    ``reduction``: "none" gives the per-token loss (0 where ignored), "sum", or "mean"
    over the tokens that are not ``ignore_index`` (like ``torch.nn.functional.cross_entropy``).
    ``chunk_tokens``: compute it this many tokens at a time (fp32 work tensors [chunk_tokens, V/tp]).
    """
    if vocab_size is None:
        vocab_size = logits.shape[-1] * tp_world_size()
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if chunk_tokens:
        loss = _ChunkedVocabParallelCrossEntropy.apply(logits, target, vocab_size, ignore_index, label_smoothing,
                                                       chunk_tokens)
    else:
        loss = _VocabParallelCrossEntropy.apply(logits, target, vocab_size, ignore_index, label_smoothing)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (target != ignore_index).sum().clamp(min=1)
    raise ValueError(f"unknown reduction {reduction!r}")
