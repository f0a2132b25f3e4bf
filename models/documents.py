"""Packed sequences with their document boundaries kept: each token attends only to the earlier tokens of its own
document, and positions restart at 0 with each document, so a packed row computes what its documents compute
alone.

``DocumentAttention`` goes to the GPT's forward (``model(ids, labels, documents=...)``), which runs its layers
through ``layers_output`` inside the model's own call (so ZeRO-3 gathers the tied output layer's weight as for any
forward) and computes the loss as for any row (context-parallel sums, the tiled or chunked loss, the MoE layers'
auxiliary losses). Each layer's attention reads it as it reads a KV cache (``positions``, ``attn_mask``,
``is_causal``, ``update``), with nothing cached: the block-diagonal causal mask goes to SDPA and the
per-document positions to RoPE and to gpt2's position table. Under Megatron sequence parallelism the attention
sees the whole sequence (all-gathered), so only the embedding takes its rank's chunk of the positions; under
context parallelism (Ulysses) each rank embeds and rotates its chunk with the chunk's positions, and the
all-to-all gives the masked core every position of its heads, where the whole mask applies.
"""
from __future__ import annotations

import copy
import functools
from typing import Sequence

import torch
import torch.nn.functional as F

from .moe import MoEMLP
from .parallel import UlyssesAttention, context_chunk, cp_world_size, tp_rank, tp_world_size


class DocumentAttention:
    def __init__(self, document_lengths: Sequence[Sequence[int]], device=None):
        """``document_lengths``: for each row of the batch, the lengths of its documents in order (they add up to
        the row's length, padding counted as a document of its own)."""
        totals = {sum(row) for row in document_lengths}
        if len(totals) != 1:
            raise ValueError(f"every row's document lengths must add up to the same length, got {sorted(totals)}")
        ids = [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in document_lengths]
        self._set_boundaries(torch.stack(ids).to(device))

    def _set_boundaries(self, document_ids: torch.Tensor) -> None:
        """From [b, s] ids numbering each token's document (0, 1, ... in order): each token's position within its
        document and the [b, 1, s, s] mask of the earlier tokens of the same document."""
        s = document_ids.shape[1]
        index = torch.arange(s, device=document_ids.device).expand_as(document_ids)
        first = torch.ones_like(document_ids, dtype=torch.bool)
        first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        starts = torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
        self.document_ids, self.positions = document_ids, index - starts
        same = document_ids[:, :, None] == document_ids[:, None, :]
        self.attn_mask = (same & torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril())[:, None]
        self.is_causal = False

    def layer(self, index: int) -> "DocumentAttention":
        return self

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v  # nothing is cached: the keys and values are the row's own

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention of [b, heads, s, d] queries over the whole rows' keys and values, within documents."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.attn_mask, enable_gqa=k.shape[1] != q.shape[1])

    def context_attention(self, local_heads: int, local_kv_heads: int) -> UlyssesAttention:
        """Under context parallelism: DeepSpeed-Ulysses around ``core`` (the all-to-all gives it every position)."""
        return UlyssesAttention(self.core, local_heads, local_kv_heads)

    def chunk(self) -> "DocumentAttention":
        """What this context-parallel rank's layers read: its chunk's positions (for RoPE), the whole mask (for the
        core, after Ulysses' all-to-all)."""
        if cp_world_size() == 1:
            return self
        view = copy.copy(self)
        view.positions = context_chunk(self.positions)
        return view

    @classmethod
    def of_ids(cls, document_ids: torch.Tensor) -> "DocumentAttention":
        """The boundaries of rows whose [b, s] ``document_ids`` number each token's document (0, 1, ... in order):
        what a pipeline stage rebuilds from the ids that travel with the hidden states."""
        view = cls.__new__(cls)
        view._set_boundaries(document_ids)
        return view

    def embedding_inputs(self, input_ids: torch.Tensor, sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """What the embedding takes for the rows' tokens at their documents' positions: this rank's chunk under
        context (this view being ``chunk()``'s) and sequence parallelism."""
        positions = self.positions
        if sequence_parallel:  # the embedding's output is this TP rank's chunk of the sequence
            positions = positions.chunk(tp_world_size(), dim=1)[tp_rank()]
        return context_chunk(input_ids), positions

    def layers_output(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """A GPT's hidden states after its layers (before the final norm) over packed rows, each document seen
        alone: this rank's [b, s / cp, h], [b, s / cp / tp, h] under sequence parallelism. In training each layer
        goes through the model's ``checkpoint_fn`` when it has one (full recomputation: only the layer's input is
        kept). Attention dropout does not apply on this path."""
        if model.training and model.config.attention_dropout:
            raise ValueError("packed documents: attention dropout is not applied on this path; set attention_dropout 0")
        if model.mtp is not None:
            raise ValueError("packed documents: multi-token prediction reads whole rows across documents; "
                             "set mtp_num_layers 0")
        documents = self.chunk()
        h = model.embedding(*documents.embedding_inputs(input_ids, model.layout.sequence_parallel))
        recompute = model.checkpoint_fn if model.training and torch.is_grad_enabled() else None
        if recompute is not None and not h.requires_grad:  # a frozen embedding (LoRA): a reentrant checkpoint's
            h.requires_grad_()  # output has a gradient only if an input has one (enable_input_require_grads)
        for i, layer in enumerate(model.layers):
            if recompute is not None and not isinstance(layer.mlp, MoEMLP):  # (as GPT's: an MoE layer's auxiliary
                h = recompute(functools.partial(layer, cache=documents.layer(i)), h)  # loss keeps this forward's graph)
            else:
                h = layer(h, documents.layer(i))
        return h
