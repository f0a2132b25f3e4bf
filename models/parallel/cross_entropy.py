"""Cross-entropy over vocabulary-parallel logits, never gathering the full logits.

Each rank holds the logits of its slice of the (padded) vocabulary. The max,
the sum of exponentials, the target logit and (for label smoothing) the sum of
logits are reduced across ranks as a few scalars per token, in fp32.
Padding columns (index >= ``vocab_size``) are excluded: never predicted, and
not counted in label smoothing.
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


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, vocab_size: int | None = None,
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` (this rank's vocabulary slice, [..., V/tp]) against ``target`` [...].

    ``reduction``: "none" gives the per-token loss (0 where ignored), "sum", or "mean"
    over the tokens that are not ``ignore_index`` (like ``torch.nn.functional.cross_entropy``).
    """
    if vocab_size is None:
        vocab_size = logits.shape[-1] * tp_world_size()
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    loss = _VocabParallelCrossEntropy.apply(logits, target, vocab_size, ignore_index, label_smoothing)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (target != ignore_index).sum().clamp(min=1)
    raise ValueError(f"unknown reduction {reduction!r}")
