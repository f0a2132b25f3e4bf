"""Multi-head latent attention (DeepSeek-V2/V3, transformers' ``DeepseekV3Attention``).

The keys and values of all heads come from one compressed latent per token: ``kv_a_proj`` maps the hidden state to
the latent (``kv_lora_rank``, RMS-normed) and to one RoPE key part (``qk_rope_head_dim``) that every head shares
(the decoupled RoPE); ``kv_b_proj`` expands the latent into each head's key part without RoPE
(``qk_nope_head_dim``) and its value (``v_head_dim``). The query is full-rank (``q_proj``) or low-rank
(``q_a_proj`` to ``q_lora_rank``, RMS-normed, then ``q_b_proj``); each head's query is [nope part; RoPE part].
Scores are scaled by (nope + rope)^-1/2.

Tensor parallelism splits the heads: ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` are column-parallel (each rank
its heads' rows), the output projection row-parallel. The down projections to the latents are small and
replicated on every TP rank; the shared RoPE key is read by every rank's heads, so its gradient is summed over TP
(the f op, as a column-parallel linear's input).

RoPE is the rotate-half form of the project's ``RotaryEmbedding`` (given by the caller). transformers' DeepSeek-V3
rotates interleaved pairs by default (``rope_interleave``); that equals the rotate-half form on the RoPE rows of
the projections reordered [even rows; odd rows] (``deinterleave_rope_rows``), which an import does once.

Decoding caches the compressed latent (after its norm) and the RoPE key part, not the heads' keys and values:
kv_lora_rank + qk_rope_head_dim numbers a token and layer instead of heads x (nope + rope + v).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .parallel import (ColumnParallelLinear, RowParallelLinear, copy_to_tensor_parallel_region, cp_world_size,
                       normal_init, tensor_parallel_rng, tp_world_size)

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
        if cp_world_size() > 1 or getattr(config, "sequence_parallel", False):
            raise ValueError("multi-head latent attention runs without context or sequence parallelism for now")
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
        q_rope, k_rope = self.rotary(q_rope, k_rope, None if cache is None else cache.positions)
        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope)
        t = latent.shape[2]
        kv = self.kv_b_proj(latent.view(b, t, self.kv_rank)).view(b, t, self.local_heads, self.nope + self.v)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.local_heads, -1, -1)], dim=-1)
        if cache is not None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.attn_mask, is_causal=cache.is_causal)
        else:
            dropout = self.dropout if self.training else 0.0
            with tensor_parallel_rng() if dropout else contextlib.nullcontext():
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, s, self.local_heads * self.v))


def deinterleave_rope_rows(weight: torch.Tensor, rope: int, period: int) -> torch.Tensor:
    """``weight`` [rows, in] whose every ``period`` rows end with ``rope`` RoPE rows in interleaved pairs (a query
    projection: period nope + rope per head; ``kv_a_proj``: period kv_lora_rank + rope) with those rows
    reordered [even; odd]: the rotate-half RoPE on them equals the interleaved one (transformers'
    ``apply_rotary_pos_emb_interleave``) on the original rows, bit for bit."""
    blocks = weight.view(-1, period, *weight.shape[1:])
    kept, rot = blocks[:, :period - rope], blocks[:, period - rope:]
    return torch.cat([kept, rot[:, 0::2], rot[:, 1::2]], dim=1).reshape(weight.shape)
