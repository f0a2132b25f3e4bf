"""ALST's tiled compute (Arctic Long Sequence Training, DeepSpeed): the MLP and the output layer + loss run on
``N`` tiles of the sequence, so that their [s, ffn / tp] and [s, V / tp] activations are never held whole.

Both are DeepSpeed's: ``TiledMLP`` (the MLP's tiles run without autograd in the forward and are recomputed one
by one in the backward: only the MLP's input is kept) and ``sequence_tiled_compute`` (the same for the output
layer and the vocabulary-parallel cross-entropy: each tile gives its summed loss, and the backward recomputes
each tile's logits). DeepSpeed's ``TiledFusedLogitsLoss`` is not used: it runs the backward inside the forward
with an incoming gradient of 1, which a loss divided afterwards (by the token count, by fp16's loss scale)
would not reach the output layer's weight gradient with.

Tiles are per token, so they are exact: the tiled loss is the sum of the tiles' sums. Per-row sums (DPO's
completion log-probabilities, ``tiled_row_cross_entropy``) are the sums of the tiles' per-row sums.
"""
from __future__ import annotations

import math

import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, sequence_tiled_compute

from .parallel import vocab_parallel_cross_entropy


@torch.compiler.disable  # in a compiled block (models/compile.py) the tiles run eagerly between its two graphs
def tiled_mlp(fn, module: torch.nn.Module, x: torch.Tensor, tiles: int) -> torch.Tensor:
    """``fn(module, x)`` (a per-token MLP over [..., s, h]) on ``tiles`` tiles of the sequence: DeepSpeed's
    ``TiledMLP``, whose forward runs the tiles without autograd and whose backward recomputes them, which Dynamo
    does not trace."""
    return TiledMLP.apply(fn, module, x, tiles, list(module.parameters()))


def row_tiles(rows: int, tiles: int) -> int:
    """The tiles ``torch.chunk`` cuts ``rows`` rows into when asked for at most ``tiles``: fewer where the rows do not
    fill them (5 rows in 4 tiles of 2: 3). DeepSpeed's TiledMLP marks the weights' gradients ready for ZeRO at the
    tile it counts as the last, so it must be told the count the rows make."""
    if rows <= 1 or tiles <= 1:
        return 1
    return math.ceil(rows / math.ceil(rows / tiles))


def tiled_cross_entropy(logits_fn, params, hidden: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                        tiles: int, label_smoothing: float = 0.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """The summed vocabulary-parallel cross-entropy of ``logits_fn(hidden)`` ([b, s, h] replicated over TP -> [b, s,
    V/tp]) against ``labels`` [b, s], computed on ``tiles`` tiles of the sequence (``params``: the output
    layer's weights, for ZeRO's gradient hooks); ``chunk_tokens``: each tile's loss that many tokens at a time."""
    def tile_loss(hidden, labels):
        return vocab_parallel_cross_entropy(logits_fn(hidden), labels, vocab_size=vocab_size,
                                            label_smoothing=label_smoothing, reduction="sum", chunk_tokens=chunk_tokens)

    return sequence_tiled_compute(tile_loss, hidden.shape[1], tiles, {"hidden": hidden, "labels": labels}, {},
                                  "hidden", compute_params=list(params), output_unshard_dimension=0,
                                  output_reduction="sum")


class _TiledRowSums(torch.autograd.Function):
    """``fn(hidden tile, labels tile)`` -> [b] (a per-row sum over the tile's tokens), summed over the tiles of the
    sequence: each tile's forward without autograd, recomputed one tile at a time in the backward with the rows'
    incoming gradient (as DeepSpeed's ``SequenceTiledCompute``, whose outputs are either reduced to one number or
    shaped as the input: neither is a row's sum). The parameters' gradients are marked ready for ZeRO at the last
    tile only, as DeepSpeed's tiled compute marks them."""

    @staticmethod
    def forward(ctx, fn, params, tiles: int, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.params = fn, [p for p in params if p.requires_grad]
        ctx.step = math.ceil(hidden.shape[1] / tiles)
        ctx.save_for_backward(hidden, labels)
        with torch.no_grad():
            return sum(fn(hidden[:, i:i + ctx.step], labels[:, i:i + ctx.step])
                       for i in range(0, hidden.shape[1], ctx.step))

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):
        hidden, labels = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[3] else None
        starts = range(0, hidden.shape[1], ctx.step)
        for i in starts:
            for p in ctx.params:
                p.ds_grad_is_ready = i == starts[-1]
            part = hidden[:, i:i + ctx.step].detach().requires_grad_(grad_hidden is not None)
            with torch.enable_grad():
                rows = ctx.fn(part, labels[:, i:i + ctx.step])
            torch.autograd.backward(rows, grad_rows)
            if grad_hidden is not None:
                grad_hidden[:, i:i + ctx.step] = part.grad
        return None, None, None, grad_hidden, None


def tiled_row_cross_entropy(logits_fn, params, hidden: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
                            tiles: int, chunk_tokens: int | None = None) -> torch.Tensor:
    """Each row's summed vocabulary-parallel cross-entropy [b] of ``logits_fn(hidden)`` against ``labels``, on
    ``tiles`` tiles of the sequence (DPO's per-completion log-probabilities without the [s, V/tp] logits whole)."""
    def tile_rows(hidden, labels):
        return vocab_parallel_cross_entropy(logits_fn(hidden), labels, vocab_size=vocab_size, reduction="none",
                                            chunk_tokens=chunk_tokens).sum(dim=1)

    return _TiledRowSums.apply(tile_rows, list(params), tiles, hidden, labels)
