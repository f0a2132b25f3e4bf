"""Packed sequences with their document boundaries kept: each token attends only to the earlier tokens of its own
document, and positions restart at 0 with each document, so a packed row computes what its documents compute
alone.

``DocumentAttention`` speaks the protocol ``Attention.forward`` reads from a KV cache (``positions``,
``attn_mask``, ``is_causal``, ``update``), with nothing cached: the block-diagonal causal mask goes to SDPA and
the per-document positions to RoPE and to gpt2's position table. Tensor parallelism only: under sequence
parallelism each rank would need its chunk of the positions, under context parallelism Ulysses' own core.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from .moe import MoEMLP
from .parallel import cp_world_size


class DocumentAttention:
    def __init__(self, document_lengths: Sequence[Sequence[int]], device=None):
        """``document_lengths``: for each row of the batch, the lengths of its documents in order (they add up to
        the row's length, padding counted as a document of its own)."""
        totals = {sum(row) for row in document_lengths}
        if len(totals) != 1:
            raise ValueError(f"every row's document lengths must add up to the same length, got {sorted(totals)}")
        ids = [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in document_lengths]
        self.document_ids = torch.stack(ids).to(device)                                      # [b, s]
        starts = [torch.repeat_interleave(torch.tensor(row).cumsum(0) - torch.tensor(row), torch.tensor(row))
                  for row in document_lengths]
        s = self.document_ids.shape[1]
        self.positions = (torch.arange(s) - torch.stack(starts)).to(device)                    # [b, s]
        same = self.document_ids[:, :, None] == self.document_ids[:, None, :]
        causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
        self.attn_mask = (same & causal)[:, None]                                              # [b, 1, s, s]
        self.is_causal = False

    def layer(self, index: int) -> "DocumentAttention":
        return self

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v  # nothing is cached: the keys and values are the row's own


def document_parallel_logits(model, input_ids: torch.Tensor, documents: DocumentAttention) -> torch.Tensor:
    """This rank's vocabulary slice of a GPT's logits [b, s, padded_vocab / tp] over packed rows, each document seen
    alone. Runs the model's stages (embedding, layers, final norm, output layer) with ``documents`` as the
    attention's cache; in training each layer goes through the model's ``checkpoint_fn`` when it has one (full
    recomputation: only the layer's input is kept). Attention dropout does not apply on this path."""
    config = model.config
    if model.layout.sequence_parallel or cp_world_size() > 1:
        raise ValueError("packed documents are attended within their boundaries only without sequence or context "
                         "parallelism")
    if model.training and config.attention_dropout:
        raise ValueError("packed documents: attention dropout is not applied on this path; set attention_dropout 0")
    h = model.embedding(input_ids, documents.positions)
    recompute = model.checkpoint_fn if model.training and torch.is_grad_enabled() else None
    if recompute is not None and not h.requires_grad:  # a frozen embedding (LoRA): a reentrant checkpoint's output
        h.requires_grad_()  # has a gradient only if an input has one (transformers' enable_input_require_grads)
    for i, layer in enumerate(model.layers):
        if recompute is not None and not isinstance(layer.mlp, MoEMLP):  # (as GPT's: an MoE layer's auxiliary
            h = recompute(functools.partial(layer, cache=documents.layer(i)), h)  # loss keeps this forward's graph)
        else:
            h = layer(h, documents.layer(i))
    h = model.final_norm(h)
    return model.embedding.logits(h) if model.lm_head is None else model.lm_head(h)
