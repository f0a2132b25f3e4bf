"""DeepSeek-V3's layers that the GPT plugs in: multi-head latent attention (``multi_latent_attention``) and
multi-token prediction (``mtp_num_layers``).

## Multi-head latent attention (DeepSeek-V2/V3, transformers' ``DeepseekV3Attention``)

The keys and values of all heads come from one compressed latent per token: ``kv_a_proj`` maps the hidden state to
the latent (``kv_lora_rank``, RMS-normed) and to one RoPE key part (``qk_rope_head_dim``) that every head shares
(the decoupled RoPE); ``kv_b_proj`` expands the latent into each head's key part without RoPE
(``qk_nope_head_dim``) and its value (``v_head_dim``). The query is full-rank (``q_proj``) or low-rank
(``q_a_proj`` to ``q_lora_rank``, RMS-normed, then ``q_b_proj``); each head's query is [nope part; RoPE part].
Scores are scaled by (nope + rope)^-1/2.

Tensor parallelism splits the heads: ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` are column-parallel (each rank
its heads' rows), the output projection row-parallel. The down projections to the latents are small and
replicated on every TP rank; the shared RoPE key is read by every rank's heads, so its gradient is summed over TP
(the f op, as a column-parallel linear's input). Context parallelism: each rank projects its chunk of the sequence
(RoPE at the chunk's global positions), and DeepSpeed-Ulysses exchanges the expanded per-head queries, keys and
values around the same causal core (``models.parallel.UlyssesAttention``).

RoPE is the rotate-half form of the project's ``RotaryEmbedding`` (given by the caller). transformers' DeepSeek-V3
rotates interleaved pairs by default (``rope_interleave``); that equals the rotate-half form on the RoPE rows of
the projections reordered [even rows; odd rows] (``deinterleave_rope_rows``), which an import does once.

Decoding caches the compressed latent (after its norm) and the RoPE key part, not the heads' keys and values:
kv_lora_rank + qk_rope_head_dim numbers a token and layer instead of heads x (nope + rope + v).

## Multi-token prediction (DeepSeek-V3, section 2.2; transformers' ``MtpLayer`` / ``MtpModel``)

Depth k (1..D) predicts the token k + 1 places ahead: at position i it joins the previous depth's hidden state
h^{k-1}_i (depth 0: the main model's final-normed output, as transformers feeds its ``MtpModel``) with the embedding
of token i + k, each RMS-normed (``enorm``, ``hnorm``), concatenated [embedding; hidden] and projected back to
the model width (``eh_proj``), runs one transformer layer (an MoE layer where the model has experts, as
transformers builds them), and normalises the result (``final_norm``: DeepSeek's ``shared_head.norm``,
transformers' ``post_norm``); the main model's embedding and output layer are shared. Positions past the sequence
read a padding token and are not scored, so a depth never sees a token it predicts (the attention is causal).

The training loss adds ``mtp_loss_scaling_factor`` (lambda) x the mean over the depths of each depth's
cross-entropy (DeepSeek-V3's equation 25). Under TP the embedding and the output layer are the vocab-parallel ones
of the main model; ``eh_proj`` is replicated. Under context parallelism the shifts are the whole sequence's, each
rank embeds and scores its chunk of the shifted tokens, and a depth's loss is the whole sequence's mean (the chunks'
sums added over the context group, as the main loss).
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .parallel import (ColumnParallelLinear, RowParallelLinear, UlyssesAttention, chunk_start, context_chunk,
                       copy_to_tensor_parallel_region, cp_world_size, global_count, normal_init,
                       reduce_from_context_parallel_region, tensor_parallel_rng, tp_world_size,
                       vocab_parallel_cross_entropy)

# the latents' RMSNorms use DeepSeek's default epsilon whatever the model's norm_eps (transformers' and DeepSeek's
# own code build them without the config's)
LATENT_NORM_EPS = 1e-6


def _replicated_linear(n_in: int, n_out: int, std: float) -> nn.Linear:
    linear = nn.Linear(n_in, n_out, bias=False)
    nn.init.normal_(linear.weight, std=std)
    return linear


class MultiLatentAttention(nn.Module):
    """Causal MLA over [b, s, h] (replicated over TP); ``rotary``: a ``RotaryEmbedding`` of ``qk_rope_head_dim``."""

    def __init__(self, config: GPTConfig, rotary: nn.Module):
        super().__init__()
        tp, h, heads = tp_world_size(), config.hidden_size, config.num_heads
        self.local_heads = heads // tp
        self.nope, self.rope, self.v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        qk, init = self.nope + self.rope, normal_init(config.init_std)
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * qk, bias=False, init_method=init)
        else:
            self.q_a_proj = _replicated_linear(h, config.q_lora_rank, config.init_std)
            self.q_a_norm = nn.RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk, bias=False, init_method=init)
        self.kv_a_proj = _replicated_linear(h, self.kv_rank + self.rope, config.init_std)
        self.kv_a_norm = nn.RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, heads * (self.nope + self.v), bias=False,
                                              init_method=init)
        self.dense = RowParallelLinear(heads * self.v, h, bias=False, input_is_parallel=True,
                                       init_method=normal_init(config.init_std / math.sqrt(2.0 * config.num_layers)))
        self.low_rank_query = config.q_lora_rank is not None
        self.rotary = rotary
        self.dropout = config.attention_dropout
        # context parallelism: DeepSpeed-Ulysses around the same core, each head's [nope; rope] query and key and
        # its value exchanged (every head has its own key once expanded from the latent)
        self.context = (UlyssesAttention(self._core, self.local_heads, self.local_heads)
                        if cp_world_size() > 1 else None)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.low_rank_query:
            return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        return self.q_proj(x)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        """``cache``: a ``models.kv_cache.LayerCache`` (decoding): it keeps the compressed latent and the RoPE key
        part of every token read ([b, 1, t, kv_lora_rank] and [b, 1, t, rope]), expanded per head at each step."""
        b, s, _ = x.shape
        q = self._query(x).view(b, s, self.local_heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_norm(latent).view(b, 1, s, self.kv_rank)
        # every rank's heads read the one RoPE key: its gradient is their sum over TP
        k_rope = copy_to_tensor_parallel_region(k_rope).reshape(b, 1, s, self.rope)
        positions = cache.positions if cache is not None else (  # under CP: the global positions of this chunk
            None if self.context is None else torch.arange(s, device=x.device)[None] + chunk_start(s))
        q_rope, k_rope = self.rotary(q_rope, k_rope, positions)
        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope)
        t = latent.shape[2]
        kv = self.kv_b_proj(latent.view(b, t, self.kv_rank)).view(b, t, self.local_heads, self.nope + self.v)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.local_heads, -1, -1)], dim=-1)
        if cache is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.attn_mask, is_causal=cache.is_causal)
        elif self.context is not None:  # [b, s / C, heads, v]
            return self.dense(self.context(q, k, v).reshape(b, s, self.local_heads * self.v))
        else:
            y = self._core(q, k, v)
        return self.dense(y.transpose(1, 2).reshape(b, s, self.local_heads * self.v))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of [b, heads, s, .] queries, keys and values over the whole sequence."""
        dropout = self.dropout if self.training else 0.0
        with tensor_parallel_rng() if dropout else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


def deinterleave_rope_rows(weight: torch.Tensor, rope: int, period: int) -> torch.Tensor:
    """``weight`` [rows, in] whose every ``period`` rows end with ``rope`` RoPE rows in interleaved pairs (a query
    projection: period nope + rope per head; ``kv_a_proj``: period kv_lora_rank + rope) with those rows
    reordered [even; odd]: the rotate-half RoPE on them equals the interleaved one (transformers'
    ``apply_rotary_pos_emb_interleave``) on the original rows, bit for bit."""
    blocks = weight.view(-1, period, *weight.shape[1:])
    kept, rot = blocks[:, :period - rope], blocks[:, period - rope:]
    return torch.cat([kept, rot[:, 0::2], rot[:, 1::2]], dim=1).reshape(weight.shape)


def interleave_rope_rows(weight: torch.Tensor, rope: int, period: int) -> torch.Tensor:
    """The inverse of ``deinterleave_rope_rows``: [even; odd] RoPE rows back into interleaved pairs (an export to
    transformers' ``rope_interleave`` layout)."""
    blocks = weight.view(-1, period, *weight.shape[1:])
    kept, rot = blocks[:, :period - rope], blocks[:, period - rope:]
    pairs = torch.stack([rot[:, :rope // 2], rot[:, rope // 2:]], dim=2).flatten(1, 2)
    return torch.cat([kept, pairs], dim=1).reshape(weight.shape)


class MTPLayer(nn.Module):
    """One depth around ``block`` (a ``models.gpt.TransformerLayer``); ``seed`` draws ``eh_proj``."""

    def __init__(self, config: GPTConfig, block: nn.Module, seed: int):
        super().__init__()
        h = config.hidden_size
        self.enorm = nn.RMSNorm(h, eps=config.norm_eps)
        self.hnorm = nn.RMSNorm(h, eps=config.norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        nn.init.normal_(self.eh_proj.weight, std=config.init_std, generator=torch.Generator().manual_seed(seed))
        self.block = block
        self.final_norm = nn.RMSNorm(h, eps=config.norm_eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        return self.final_norm(self.block(self.eh_proj(joined)))


def shifted(ids: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``ids`` [b, s] moved k places left, the last k filled with ``fill``."""
    return torch.cat([ids[:, k:], ids.new_full((ids.shape[0], min(k, ids.shape[1])), fill)], dim=1)


class MultiTokenPrediction(nn.Module):
    """The D depths, each around one of ``blocks``, in order; depth d's ``eh_proj`` drawn from ``seed + 2 d``."""

    def __init__(self, config: GPTConfig, blocks: list[nn.Module], seed: int):
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(config, block, seed + 2 * d) for d, block in enumerate(blocks))
        self.vocab_size = config.vocab_size

    def hidden_states(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                      embed: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """Each depth's final-normed output [b, s, h]; ``hidden`` the main model's, ``embed`` its token embedding.
        Depth k at position i predicts token i + k + 1 (valid where i + k + 1 <= s). Under context parallelism
        ``hidden`` is this rank's chunk of the sequence and ``input_ids`` the whole one: the shift is the whole
        sequence's, each rank embeds its chunk of it."""
        out = []
        for k, layer in enumerate(self.layers, start=1):
            hidden = layer(hidden, embed(context_chunk(shifted(input_ids, k, 0))))
            out.append(hidden)
        return out

    def loss(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
             embed: Callable[[torch.Tensor], torch.Tensor],
             logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The mean over the depths of their cross-entropies (``labels``: the main model's, shifted already;
        ``logits``: this rank's vocabulary slice of the shared output layer)."""
        losses = [self._cross_entropy(logits(h), shifted(labels, k, -100))
                  for k, h in enumerate(self.hidden_states(hidden, input_ids, embed), start=1)]
        return torch.stack(losses).mean()

    def _cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean over the whole sequence's scored tokens; under context parallelism from this rank's chunk of the
        logits, the chunks' sums added over the context group (each rank's gradient its own tokens')."""
        if cp_world_size() == 1:
            return vocab_parallel_cross_entropy(logits, labels, vocab_size=self.vocab_size)
        labels = context_chunk(labels)
        loss = vocab_parallel_cross_entropy(logits, labels, vocab_size=self.vocab_size, reduction="none")
        return reduce_from_context_parallel_region(loss.sum()) / global_count(labels != -100).clamp(min=1)

    def moe_aux_loss(self) -> torch.Tensor | float:
        """The auxiliary losses of the depths' MoE layers from the last forward (0.0: none)."""
        losses = [getattr(layer.block.mlp, "aux_loss", None) for layer in self.layers]
        return sum(loss for loss in losses if loss is not None)
