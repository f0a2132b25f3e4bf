"""ALST's tiled compute (Arctic Long Sequence Training, DeepSpeed): the MLP and the output layer + loss run on
``N`` tiles of the sequence, so that their [s, ffn / tp] and [s, V / tp] activations are never held whole.

Both are DeepSpeed's: ``TiledMLP`` (the MLP's tiles run without autograd in the forward and are recomputed one
by one in the backward: only the MLP's input is kept) and ``sequence_tiled_compute`` (the same for the output
layer and the vocabulary-parallel cross-entropy: each tile gives its summed loss, and the backward recomputes
each tile's logits). DeepSpeed's ``TiledFusedLogitsLoss`` is not used: it runs the backward inside the forward
with an incoming gradient of 1, which a loss divided afterwards (by the token count, by fp16's loss scale)
would not reach the output layer's weight gradient with.

Tiles are per token, so they are exact: the tiled loss is the sum of the tiles' sums.
"""
from __future__ import annotations

import math

import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, sequence_tiled_compute

from .parallel import vocab_parallel_cross_entropy


def tiled_mlp(fn, module: torch.nn.Module, x: torch.Tensor, tiles: int) -> torch.Tensor:
    """``fn(module, x)`` (a per-token MLP over [..., s, h]) on ``tiles`` tiles of the sequence."""
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
