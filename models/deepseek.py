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
(the f op, as a column-parallel linear's input). Sequence parallelism: the down projections and the latents'
norms run on this rank's chunk of the sequence (their gradients summed over TP, as a sequence-parallel norm's);
the latents and the RoPE key are all-gathered along the sequence into the up projections (their gradients
reduce-scattered), the output projection reduce-scatters. Context parallelism: each rank projects its chunk of
the sequence (RoPE at the chunk's global positions), and DeepSpeed-Ulysses exchanges the expanded per-head queries,
keys and values around the same causal core (``models.parallel.UlyssesAttention``).

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
sums added over the context group, as the main loss). Under sequence parallelism a depth runs on this rank's chunk
of the sequence as the main model's layers do (the embedding reduce-scattered, the norms and ``eh_proj`` replicated
parameters of sequence-split activations), and the output layer gathers it.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .parallel import (ColumnParallelLinear, RowParallelLinear, SequenceParallelRMSNorm, UlyssesAttention,
                       causal_attention_from, chunk_start, context_chunk, copy_to_tensor_parallel_region,
                       cp_world_size, gather_from_sequence_parallel_region, global_count, mark_sequence_parallel,
                       normal_init, reduce_from_context_parallel_region, sequence_parallel_parameter,
                       tensor_parallel_stream, tp_world_size, vocab_parallel_cross_entropy)

# the latents' RMSNorms use DeepSeek's default epsilon whatever the model's norm_eps (transformers' and DeepSeek's
# own code build them without the config's)
LATENT_NORM_EPS = 1e-6


class ReplicatedLinear(nn.Linear):
    """A bias-free linear replicated on every TP rank. ``sequence_parallel``: it reads this rank's chunk of the
    sequence, so its gradient is summed over the TP group (a sequence-parallel norm's treatment)."""

    def __init__(self, n_in: int, n_out: int, sequence_parallel: bool = False):
        super().__init__(n_in, n_out, bias=False)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, sequence_parallel_parameter(self.weight) if self.sequence_parallel else self.weight)


def _replicated_linear(n_in: int, n_out: int, std: float, sequence_parallel: bool) -> ReplicatedLinear:
    linear = ReplicatedLinear(n_in, n_out, sequence_parallel)
    nn.init.normal_(linear.weight, std=std)
    return linear


def _rms_norm(width: int, eps: float, sequence_parallel: bool) -> nn.RMSNorm:
    return (SequenceParallelRMSNorm if sequence_parallel else nn.RMSNorm)(width, eps=eps)


class MultiLatentAttention(nn.Module):
    """Causal MLA over [b, s, h] (replicated over TP, or this rank's [b, s / tp, h] under ``sequence_parallel``);
    ``rotary``: a ``RotaryEmbedding`` of ``qk_rope_head_dim``."""

    def __init__(self, config: GPTConfig, rotary: nn.Module, sequence_parallel: bool = False):
        super().__init__()
        tp, h, heads, sp = tp_world_size(), config.hidden_size, config.num_heads, sequence_parallel
        self.local_heads = heads // tp
        self.nope, self.rope, self.v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        qk, init = self.nope + self.rope, normal_init(config.init_std)
        if config.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, heads * qk, bias=False, init_method=init, sequence_parallel=sp)
        else:
            self.q_a_proj = _replicated_linear(h, config.q_lora_rank, config.init_std, sp)
            self.q_a_norm = _rms_norm(config.q_lora_rank, LATENT_NORM_EPS, sp)
            self.q_b_proj = ColumnParallelLinear(config.q_lora_rank, heads * qk, bias=False, init_method=init,
                                                 sequence_parallel=sp)
        self.kv_a_proj = _replicated_linear(h, self.kv_rank + self.rope, config.init_std, sp)
        self.kv_a_norm = _rms_norm(self.kv_rank, LATENT_NORM_EPS, sp)
        self.kv_b_proj = ColumnParallelLinear(self.kv_rank, heads * (self.nope + self.v), bias=False,
                                              init_method=init, sequence_parallel=sp)
        self.dense = RowParallelLinear(heads * self.v, h, bias=False, input_is_parallel=True,
                                       init_method=normal_init(config.init_std / math.sqrt(2.0 * config.num_layers)),
                                       sequence_parallel=sp)
        self.low_rank_query = config.q_lora_rank is not None
        # sequence parallelism: the down projections and their norms run on this rank's chunk of the sequence; the
        # latents (narrower than the hidden states) are all-gathered into the up projections, the output
        # reduce-scattered (Megatron-Core's MLA does the same)
        self.sequence_parallel = sp and tp > 1
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

    def _shared_rope_key(self, k_rope: torch.Tensor) -> torch.Tensor:
        """The RoPE key part of the whole sequence, read by every rank's heads: its gradient is their sum over TP
        (the f op; under sequence parallelism the gather's reduce-scatter)."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(k_rope, 1)
        return copy_to_tensor_parallel_region(k_rope)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        """``cache``: a ``models.kv_cache.LayerCache`` (decoding): it keeps the compressed latent and the RoPE key
        part of every token read ([b, 1, t, kv_lora_rank] and [b, 1, t, rope]), expanded per head at each step."""
        if cache is not None and self.sequence_parallel:
            raise ValueError("decoding with a KV cache runs without sequence parallelism")
        q = self._query(x)  # the whole sequence (the latent gathered under sequence parallelism)
        b, s, _ = q.shape
        q = q.view(b, s, self.local_heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_norm(latent)  # this rank's chunk under sequence parallelism
        k_rope = self._shared_rope_key(k_rope).reshape(b, 1, s, self.rope)
        offset = chunk_start(s) if self.context is not None else 0  # under CP: this chunk's global positions
        q_rope, k_rope = self.rotary(q_rope, k_rope, cache.positions if cache is not None else None, offset)
        if cache is not None:
            latent, k_rope = cache.update(latent.view(b, 1, s, self.kv_rank), k_rope)
            latent = latent.view(b, -1, self.kv_rank)
        t = k_rope.shape[2]
        kv = self.kv_b_proj(latent).view(b, t, self.local_heads, self.nope + self.v)
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
        return causal_attention_from(tensor_parallel_stream() if dropout else None, q, k, v, dropout)


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
    """One depth around ``block`` (a ``models.gpt.TransformerLayer``); ``seed`` draws ``eh_proj``. Under
    ``sequence_parallel`` it reads and gives this rank's chunk of the sequence, as the main model's layers: the
    norms and ``eh_proj`` are then replicated parameters of sequence-split activations (gradients summed over TP)."""

    def __init__(self, config: GPTConfig, block: nn.Module, seed: int, sequence_parallel: bool = False):
        super().__init__()
        h, sp = config.hidden_size, sequence_parallel
        self.enorm = _rms_norm(h, config.norm_eps, sp)
        self.hnorm = _rms_norm(h, config.norm_eps, sp)
        self.eh_proj = ReplicatedLinear(2 * h, h, sp)
        nn.init.normal_(self.eh_proj.weight, std=config.init_std, generator=torch.Generator().manual_seed(seed))
        self.block = block
        self.final_norm = _rms_norm(h, config.norm_eps, sp)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        joined = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        return self.final_norm(self.block(self.eh_proj(joined)))


def shifted(ids: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``ids`` [b, s] moved k places left, the last k filled with ``fill``."""
    return torch.cat([ids[:, k:], ids.new_full((ids.shape[0], min(k, ids.shape[1])), fill)], dim=1)


def depth_inputs(input_ids: torch.Tensor, depths: int,
                 embed: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Depth k's input tokens (k = 1..``depths``): ``input_ids`` moved k places left, embedded. Under context
    parallelism ``input_ids`` is the whole sequence: the shift is the whole sequence's, each rank embeds its chunk
    of it; under sequence parallelism ``embed``'s output is this rank's chunk of that (the vocab-parallel embedding
    reduce-scatters)."""
    return [embed(context_chunk(shifted(input_ids, k, 0))) for k in range(1, depths + 1)]


def depths_loss(depth_logits: list[torch.Tensor], labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The mean over the depths of their cross-entropies, depth k scored against ``labels`` moved k places left."""
    losses = [depth_cross_entropy(logits, shifted(labels, k, -100), vocab_size)
              for k, logits in enumerate(depth_logits, start=1)]
    return torch.stack(losses).mean()


def depth_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The mean over the whole sequence's scored tokens; under context parallelism from this rank's chunk of the
    logits, the chunks' sums added over the context group (each rank's gradient its own tokens')."""
    if cp_world_size() == 1:
        return vocab_parallel_cross_entropy(logits, labels, vocab_size=vocab_size)
    labels = context_chunk(labels)
    loss = vocab_parallel_cross_entropy(logits, labels, vocab_size=vocab_size, reduction="none")
    return reduce_from_context_parallel_region(loss.sum()) / global_count(labels != -100).clamp(min=1)


class MultiTokenPrediction(nn.Module):
    """The D depths, each around one of ``blocks``, in order; depth d's ``eh_proj`` drawn from ``seed + 2 d``."""

    def __init__(self, config: GPTConfig, blocks: list[nn.Module], seed: int, sequence_parallel: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(config, block, seed + 2 * d, sequence_parallel)
                                    for d, block in enumerate(blocks))
        self.vocab_size = config.vocab_size

    def hidden_states(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                      embed: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """Each depth's final-normed output [b, s, h]; ``hidden`` the main model's, ``embed`` its token embedding.
        Depth k at position i predicts token i + k + 1 (valid where i + k + 1 <= s)."""
        return self.depths(hidden, depth_inputs(input_ids, len(self.layers), embed))

    def depths(self, hidden: torch.Tensor, embedded: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each depth's output from the main model's ``hidden`` (this rank's chunk, as its layers give it) and the
        depths' ``depth_inputs``."""
        out = []
        for layer, tokens in zip(self.layers, embedded):
            hidden = layer(hidden, tokens)
            out.append(hidden)
        return out

    def loss(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
             embed: Callable[[torch.Tensor], torch.Tensor],
             logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The mean over the depths of their cross-entropies (``labels``: the main model's, shifted already;
        ``logits``: this rank's vocabulary slice of the shared output layer)."""
        return depths_loss([logits(h) for h in self.hidden_states(hidden, input_ids, embed)], labels, self.vocab_size)

    def moe_aux_loss(self) -> torch.Tensor | float:
        """The auxiliary losses of the depths' MoE layers from the last forward (0.0: none)."""
        losses = [getattr(layer.block.mlp, "aux_loss", None) for layer in self.layers]
        return sum(loss for loss in losses if loss is not None)
