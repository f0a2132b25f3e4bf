"""A GPT built from the tensor-parallel blocks; reads in one sitting.

Two variants (``GPTConfig.variant``):
  gpt2  - learned positions, LayerNorm, GELU (tanh) MLP, biases, tied embeddings;
  llama - RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases; options: biases on Q, K, V only
          (``qkv_bias``, Qwen2), RMSNorm on each Q and K head before RoPE (``qk_norm``, Qwen3).

Layout is [batch, seq, hidden]. Attention heads, MLP columns and the
vocabulary are split across tensor-parallel ranks; everything else is
replicated, or with ``sequence_parallel`` (Korthikanti et al. 2022) split along
the sequence: each TP rank embeds, normalises, drops out and adds residuals on
its own chunk of the sequence, the chunks are all-gathered entering attention,
the MLP and the output layer, and reduce-scattered leaving them.
The model is a sequence of stages (``Embedding``, ``TransformerLayer``
x L, ``FinalNorm``, ``LMHead``) so that the same modules, with the same
parameter names, make up DeepSpeed's pipeline stages (pipeline/engine/pipe_model.py).

Labels are given already shifted: the model reads ``tokens[:, :-1]`` and is
scored against ``tokens[:, 1:]`` (as Megatron's data does).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .feed_forward import FeedForward
from .deepseek import MultiLatentAttention, MultiTokenPrediction, shifted
from .moe import ExpertMLP, MoEMLP, is_moe_layer
from .recompute import DiscardedOutput, compiled_recompute
from .tiling import tiled_cross_entropy, tiled_mlp, tiled_row_cross_entropy
from .parallel.plain_attention import short_causal_attention
from .parallel import (ColumnParallelLinear, HeadRMSNorm, Layout, RowParallelLinear, SequenceParallelLayerNorm,
                       SequenceParallelRMSNorm, UlyssesAttention, VocabParallelEmbedding, causal_attention_from,
                       chunk_start, context_chunk, copy_to_tensor_parallel_region, cp_world_size, dropout_from,
                       gather_from_context_parallel_region, gather_from_sequence_parallel_region, get_parallel_state,
                       gather_from_tensor_parallel_region, global_count, mark_sequence_parallel, normal_init,
                       reduce_from_context_parallel_region, sequence_chunk_stream, sequence_gather_linear,
                       sequence_parallel_parameter, tensor_parallel_stream, tp_rank, tp_world_size,
                       vocab_parallel_cross_entropy, vocab_parallel_parameter)


@contextlib.contextmanager
def seeded_init(seed: int | None):
    """Draw a stage's initial weights from its own seed, so that they do not depend on which
    other stages this process builds (pipeline stages build only their own layers)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def stage_seed(init_seed: int | None, index: int) -> int | None:
    """Seed of stage ``index`` (0 embedding, 1..L layers, L+1 final norm, L+2 output layer)."""
    return None if init_seed is None else init_seed + index


def _norm(config: GPTConfig, sp: bool) -> nn.Module:
    if config.variant == "gpt2":
        return (SequenceParallelLayerNorm if sp else nn.LayerNorm)(config.hidden_size, eps=config.norm_eps)
    return (SequenceParallelRMSNorm if sp else nn.RMSNorm)(config.hidden_size, eps=config.norm_eps)


def _dropout(drop: nn.Dropout, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Dropout on the residual stream: replicated activations draw the same mask on every TP rank; sequence-split
    ones (by SP or CP) draw from their rank's stream, so that each chunk gets its own mask (models/parallel/random)."""
    if not (drop.p > 0 and drop.training):
        return drop(x)
    return dropout_from(sequence_chunk_stream(sequence_parallel), x, drop.p)


def _output_init(config: GPTConfig):
    # GPT-2 / Megatron: layers that write into the residual stream get std / sqrt(2 L).
    return normal_init(config.init_std / math.sqrt(2.0 * config.num_layers))


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half form used by Hugging Face's Llama.

    The angles are computed in fp32, then cached per device and dtype for the longest sequence seen
    (a plain attribute, not a buffer: a cast of the model to bf16 must not round the fp32 angles, and
    the tables are not part of the state dict).
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._tables = {}  # (device, dtype) -> (cos, sin) [max_seq, head_dim]

    def cos_sin(self, s: int, device, dtype):
        cos, sin = self._tables.get((device, dtype), (None, None))
        if cos is None or cos.shape[0] < s:
            with torch.inference_mode(False):  # tables made under inference_mode could not be used in training
                cos, sin = self._angles(s, device, dtype)
            self._tables[(device, dtype)] = cos, sin
        return cos[:s], sin[:s]

    def _angles(self, s: int, device, dtype):
        d = self.head_dim
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        freqs = torch.outer(torch.arange(s, dtype=torch.float32, device=device), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None, offset: int = 0):
        """``positions`` [b, s]: each row's token positions (decoding with a KV cache); default ``offset`` ..
        ``offset`` + s - 1 (a context-parallel rank's chunk: a host integer, where the largest of a positions
        tensor would be read back from it, a graph break in a compiled block)."""
        if positions is None:
            cos, sin = self.cos_sin(offset + q.shape[-2], q.device, q.dtype)
            cos, sin = cos[offset:], sin[offset:]
        else:
            cos, sin = self.cos_sin(int(positions.max()) + 1, q.device, q.dtype)
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


# Up to this many tokens, causal attention on a CPU runs as plain matrix products (short_causal_attention):
# PyTorch's CPU flash kernel is built for long sequences: its forward and backward took 2.0-2.3x longer at
# 32-64 tokens and 1.4x at 128 (bf16, 16 x 9 heads, bench/README.md); from ~200 tokens on it is the faster
SHORT_CPU_ATTENTION = 128


class Attention(nn.Module):
    """Causal self-attention, heads split across TP ranks (column-parallel QKV, row-parallel output)."""

    def __init__(self, config: GPTConfig, layout: Layout):
        super().__init__()
        tp = tp_world_size()
        d = config.head_dim
        self.local_heads = config.num_heads // tp
        self.local_kv_heads = config.num_kv_heads // tp
        self.head_dim = d
        self.dropout = config.attention_dropout
        sp = layout.sequence_parallel
        self.qkv = ColumnParallelLinear(
            config.hidden_size, output_sizes=(config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d),
            bias=config.bias or config.qkv_bias, init_method=normal_init(config.init_std), sequence_parallel=sp)
        self.dense = RowParallelLinear(config.num_heads * d, config.hidden_size, bias=config.bias,
                                       input_is_parallel=True, init_method=_output_init(config), sequence_parallel=sp)
        self.rotary = (RotaryEmbedding(d, config.rope_theta)
                       if config.variant == "llama" else None)
        if config.qk_norm:
            self.q_norm = HeadRMSNorm(d, eps=config.norm_eps)
            self.k_norm = HeadRMSNorm(d, eps=config.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # context parallelism: DeepSpeed-Ulysses around the same core (models/parallel/context.py)
        self.context = (UlyssesAttention(self._attend, self.local_heads, self.local_kv_heads)
                        if cp_world_size() > 1 else None)
        self.recompute_fn = None  # selective recomputation: a checkpoint function around the core attention

    def _attend(self, q, k, v):
        """The core attention, recomputed in the backward under selective recomputation (``recompute_fn``); under
        context parallelism between Ulysses' all-to-alls, which are not repeated."""
        if self.recompute_fn is not None and self.training:
            if torch.compiler.is_compiling():  # the compiler's recomputation, which Dynamo traces
                return self._core(q, k, v, recompute=compiled_recompute)
            return self.recompute_fn(self._core, q, k, v)
        return self._core(q, k, v)

    def _core(self, q, k, v, recompute=None):
        """Causal attention of [b, heads, s, d] queries, keys and values over the whole sequence; ``recompute(fn,
        *tensors)``: how a compiled block recomputes it."""
        dropout = self.dropout if self.training else 0.0
        if not dropout and q.device.type == "cpu" and k.shape[2] <= SHORT_CPU_ATTENTION:
            return recompute(short_causal_attention, q, k, v) if recompute else short_causal_attention(q, k, v)
        return causal_attention_from(tensor_parallel_stream() if dropout else None, q, k, v, dropout,
                                     enable_gqa=k.shape[1] != q.shape[1], recompute=recompute)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        """``cache``: a ``models.kv_cache.LayerCache`` (decoding): the new tokens attend to it and join it."""
        qkv = self.qkv(x)  # the whole sequence (gathered under sequence parallelism)
        b, s, _ = qkv.shape
        q, k, v = qkv.split(self.qkv.local_output_sizes, dim=-1)
        q = q.view(b, s, self.local_heads, self.head_dim)
        k = k.view(b, s, self.local_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary is not None:  # under context parallelism: the global positions of this rank's chunk
            offset = chunk_start(s) if self.context is not None else 0
            q, k = self.rotary(q, k, cache.positions if cache is not None else None, offset)
        if cache is not None:
            k, v = cache.update(k, v)
            if self.context is not None:  # packed documents (models/documents.py): their masked core in Ulysses
                y = cache.context_attention(self.local_heads, self.local_kv_heads)(q, k, v)
                return self.dense(y.reshape(b, s, self.local_heads * self.head_dim))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.attn_mask, is_causal=cache.is_causal,
                                               enable_gqa=self.local_kv_heads != self.local_heads)
            return self.dense(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))
        if self.context is not None:
            return self.dense(self.context(q, k, v).reshape(b, s, self.local_heads * self.head_dim))
        y = self._attend(q, k, v)
        return self.dense(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


RECOMPUTE_MODULES = ("core_attn", "mlp_act", "mlp", "moe_act", "layernorm")


def select_core_attention(model: nn.Module, checkpoint_fn) -> None:
    """Selective recomputation (Korthikanti et al. 2022): every layer's core attention (scores, softmax,
    attention dropout, weighted values) is recomputed in the backward; the rest of the layer is kept."""
    select_recompute_modules(model, checkpoint_fn, ("core_attn",))


def select_recompute_modules(model: nn.Module, checkpoint_fn, modules) -> None:
    """Selective recomputation of ``modules`` (Megatron-Core's ``recompute_modules`` names where they mean the
    same): ``core_attn`` and ``mlp`` (the whole dense MLP, matmuls included) through ``checkpoint_fn``
    (DeepSpeed's, which restores the model-parallel RNG for the attention dropout); ``mlp_act`` (GELU, or SwiGLU's
    silu(gate) * up, of every dense MLP), ``moe_act`` (the same in every expert) and ``layernorm`` (both norms of
    every layer, LayerNorm or RMSNorm) by output-discarding recomputation (models/recompute.py)."""
    unknown = set(modules) - set(RECOMPUTE_MODULES)
    if unknown:
        raise ValueError(f"unknown recompute modules {sorted(unknown)}; choose from {', '.join(RECOMPUTE_MODULES)}")
    if {"mlp", "mlp_act"} <= set(modules):
        raise ValueError("recompute modules mlp and mlp_act: mlp recomputes the whole MLP, its activation included; "
                         "name one of them")
    for m in model.modules():
        if isinstance(m, Attention) and "core_attn" in modules:
            m.recompute_fn = checkpoint_fn
        elif isinstance(m, MLP):
            m.recompute_act = "mlp_act" in modules
            m.recompute_fn = checkpoint_fn if "mlp" in modules else None
        elif isinstance(m, ExpertMLP):
            m.recompute_act = "moe_act" in modules
        elif isinstance(m, TransformerLayer):
            m.recompute_norms = "layernorm" in modules


class MLP(FeedForward):
    """The dense MLP. ``recompute_fn`` (Megatron-Core's ``mlp`` recompute module): the whole block, matmuls
    included, in a checkpoint that keeps only its input."""

    def __init__(self, config: GPTConfig, layout: Layout):
        super().__init__(gated=config.variant == "llama")
        f = config.ffn_hidden_size
        sp = layout.sequence_parallel
        self.fc_in = ColumnParallelLinear(config.hidden_size, output_sizes=(f, f) if self.gated else (f,),
                                          bias=config.bias, init_method=normal_init(config.init_std),
                                          sequence_parallel=sp)
        self.fc_out = RowParallelLinear(f, config.hidden_size, bias=config.bias, input_is_parallel=True,
                                        init_method=_output_init(config), sequence_parallel=sp)
        self.tiles = layout.tiled_mlp
        self.recompute_fn = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles > 1:  # ALST: never the whole [s, ffn / tp] (models/tiling.py); recomputes its tiles anyway
            return tiled_mlp(MLP._compute, self, x, self.tiles)
        if self.recompute_fn is not None and self.training and torch.is_grad_enabled():
            recompute = compiled_recompute if torch.compiler.is_compiling() else self.recompute_fn
            return recompute(self._compute, x)
        return super().forward(x)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(.))). ``moe``: the MLP is a mixture of
    experts (``models.moe.MoEMLP``)."""

    def __init__(self, config: GPTConfig, layout: Layout, init_seed: int | None = None, moe: bool = False):
        super().__init__()
        sp = layout.sequence_parallel
        with seeded_init(init_seed):
            self.input_norm = _norm(config, sp)
            self.attention = (MultiLatentAttention(config, RotaryEmbedding(config.qk_rope_head_dim, config.rope_theta),
                                                   sp) if config.multi_latent_attention else Attention(config, layout))
            self.post_attention_norm = _norm(config, sp)
            self.mlp = (MoEMLP(config, layout, config.init_std, config.init_std / math.sqrt(2.0 * config.num_layers))
                        if moe else MLP(config, layout))
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.sequence_parallel = sp
        self.recompute_norms = False  # selective recomputation of both norms (select_recompute_modules)

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        sp = self.sequence_parallel
        if self.recompute_norms and cache is None and self.training and torch.is_grad_enabled():
            return self._forward_recomputing_norms(x)
        x = x + _dropout(self.dropout, self.attention(self.input_norm(x), cache), sp)
        return x + _dropout(self.dropout, self.mlp(self.post_attention_norm(x)), sp)

    def _forward_recomputing_norms(self, x: torch.Tensor) -> torch.Tensor:
        # each norm's output (the QKV / fc_in input) is freed once read, rebuilt from the kept norm input when
        # the attention's / MLP's output gradient arrives, as Megatron-Core's "layernorm" module
        sp = self.sequence_parallel
        if torch.compiler.is_compiling():
            x = x + _dropout(self.dropout, self.attention(compiled_recompute(self.input_norm, x)), sp)
            return x + _dropout(self.dropout, self.mlp(compiled_recompute(self.post_attention_norm, x)), sp)
        n = DiscardedOutput(self.input_norm, x)
        y = self.attention(n.output)
        n.discard(y)
        x = x + _dropout(self.dropout, y, sp)
        n = DiscardedOutput(self.post_attention_norm, x)
        y = self.mlp(n.output)
        n.discard(y)
        return x + _dropout(self.dropout, y, sp)


class Embedding(nn.Module):
    """Token (vocab-parallel) plus, for gpt2, learned position embeddings.

    Under sequence parallelism the partial token embeddings are reduce-scattered along the sequence and
    each rank adds the positions of its own chunk (so the position table is a sequence-parallel parameter).
    """

    def __init__(self, config: GPTConfig, layout: Layout, init_seed: int | None = None):
        super().__init__()
        self.config = config
        self.sequence_parallel = layout.sequence_parallel
        with seeded_init(init_seed):
            self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                          pad_multiple=config.make_vocab_size_divisible_by,
                                                          init_method=normal_init(config.init_std),
                                                          sequence_parallel=self.sequence_parallel)
            self.position_embeddings = (nn.Embedding(config.max_position_embeddings, config.hidden_size)
                                        if config.variant == "gpt2" else None)
            if self.position_embeddings is not None:
                nn.init.normal_(self.position_embeddings.weight, std=config.init_std)
                if self.sequence_parallel:
                    mark_sequence_parallel(self.position_embeddings.weight)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def logits(self, hidden: torch.Tensor, sequence_split: bool | None = None) -> torch.Tensor:
        """Output layer of a tied model: the word-embedding matrix, transposed. ``sequence_split``: whether
        ``hidden`` is this rank's sequence chunk (default: as the model's final norm gives it)."""
        split = self.sequence_parallel if sequence_split is None else sequence_split
        return parallel_lm_logits(hidden, self.word_embeddings.weight, split)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` [b, s]: each row's token positions (decoding with a KV cache); default 0..s-1."""
        s = input_ids.shape[1] if positions is None else int(positions.max()) + 1
        if s > self.config.max_sequence_length:
            limit = self.config.max_sequence_length
            raise ValueError(f"sequence of {s} tokens is longer than " + (
                f"max_position_embeddings {limit}" if limit == self.config.max_position_embeddings else
                f"sliding_window {limit} (full causal attention equals it only within the window)"))
        if positions is None:
            input_ids = context_chunk(input_ids)  # this rank's [b, s / cp] under context parallelism
        h = self.word_embeddings(input_ids)  # [b, s / cp / tp, h] under sequence parallelism
        if self.position_embeddings is not None:
            start = chunk_start(input_ids.shape[1]) + (tp_rank() * h.shape[1] if self.sequence_parallel else 0)
            if positions is None:
                positions = torch.arange(start, start + h.shape[1], device=input_ids.device)
            table = self.position_embeddings.weight
            if self.sequence_parallel:
                table = sequence_parallel_parameter(table)
            h = h + F.embedding(positions, table)
        return _dropout(self.dropout, h, self.sequence_parallel)


class FinalNorm(nn.Module):
    def __init__(self, config: GPTConfig, layout: Layout):
        super().__init__()
        self.norm = _norm(config, layout.sequence_parallel)

    def forward(self, x):
        return self.norm(x)


class LMHead(nn.Module):
    """Output layer of an untied model: a vocab-parallel weight like the input embedding's."""

    def __init__(self, config: GPTConfig, layout: Layout, init_seed: int | None = None):
        super().__init__()
        self.sequence_parallel = layout.sequence_parallel
        with seeded_init(init_seed):
            self.weight = vocab_parallel_parameter(config.vocab_size, config.hidden_size,
                                                   config.make_vocab_size_divisible_by, normal_init(config.init_std))

    def forward(self, hidden, sequence_split: bool | None = None):
        """``sequence_split``: as ``Embedding.logits``."""
        split = self.sequence_parallel if sequence_split is None else sequence_split
        return parallel_lm_logits(hidden, self.weight, split)


def parallel_lm_logits(hidden: torch.Tensor, weight: torch.Tensor, sequence_split: bool = False) -> torch.Tensor:
    """This rank's slice of the vocabulary logits for the whole sequence. A replicated input goes through the
    f op; a sequence-split one is all-gathered (the gradient reduce-scattered) inside the matmul. Gathering
    the [b, s, h] hidden states costs less memory than the [b, s, V / tp] logits they make either way."""
    if sequence_split and tp_world_size() > 1:
        return sequence_gather_linear(hidden, weight)
    return F.linear(copy_to_tensor_parallel_region(hidden), weight)


def gather_vocab_logits(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full [..., vocab_size] logits from the vocab-parallel slices; padding columns dropped."""
    return gather_from_tensor_parallel_region(local_logits)[..., :vocab_size]


def context_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                                   label_smoothing: float = 0.0, reduction: str = "mean",
                                   chunk_tokens: int | None = None) -> torch.Tensor:
    """The loss of this rank's chunk ([b, s/C, V/tp] logits, the whole [b, s] labels) as one process computes it
    over the whole sequence: the chunks' sums added over the context group, divided by the whole sequence's count
    of scored tokens; each rank's gradient is its own tokens' (``models/parallel/context.py``)."""
    labels = context_chunk(labels)
    loss = vocab_parallel_cross_entropy(logits, labels, vocab_size=vocab_size, label_smoothing=label_smoothing,
                                        reduction="none", chunk_tokens=chunk_tokens)
    if reduction == "none":
        return gather_from_context_parallel_region(loss)
    total = reduce_from_context_parallel_region(loss.sum())
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / global_count(labels != -100).clamp(min=1)
    raise ValueError(f"unknown reduction {reduction!r}")


def mtp_arguments(config: GPTConfig, layout: Layout, init_seed: int) -> tuple:
    """``models.deepseek.MultiTokenPrediction``'s arguments, the same in the GPT and on the last pipeline stage:
    depth d's layer and projection drawn from the seeds of stages L + 3 + 2d and L + 4 + 2d."""
    L = config.num_layers
    blocks = [TransformerLayer(config, layout, stage_seed(init_seed, L + 3 + 2 * d), config.num_experts > 0)
              for d in range(config.mtp_num_layers)]
    return config, blocks, stage_seed(init_seed, L + 4), layout.sequence_parallel


def model_layout(layout: Layout | None) -> Layout:
    """The layout a model is built at: the one given, else the current process groups' (a plain single process
    when none were built). A given layout must be the one the process groups were built for."""
    current = get_parallel_state().layout
    if layout is None:
        return current
    if (layout.tensor, layout.context) != (current.tensor, current.context):
        raise ValueError(f"the model's layout ({layout}) is not the process groups' ({current}); build the groups "
                         f"from the same Layout (models.parallel.initialize_model_parallel(layout=...))")
    return layout


class GPT(nn.Module):
    """``init_seed`` fixes the initial weights (each stage draws from ``init_seed + its index``);
    without it one seed is drawn from the default RNG. ``layout``: how the run lays the model out (sequence
    parallelism, tiling; ``model_layout``)."""

    def __init__(self, config: GPTConfig, init_seed: int | None = None, *, layout: Layout | None = None):
        super().__init__()
        self.layout = layout = model_layout(layout)
        config.check_parallel(tp_world_size())
        self.config = config
        if init_seed is None:
            init_seed = int(torch.randint(0, 2**31 - 1, ()))
        L = config.num_layers
        self.embedding = Embedding(config, layout, stage_seed(init_seed, 0))
        self.layers = nn.ModuleList(TransformerLayer(config, layout, stage_seed(init_seed, i + 1),
                                                     is_moe_layer(config, i)) for i in range(L))
        self.final_norm = FinalNorm(config, layout)
        self.lm_head = None if config.tie_embeddings else LMHead(config, layout, stage_seed(init_seed, L + 2))
        self.mtp = None if not config.mtp_num_layers else MultiTokenPrediction(*mtp_arguments(config, layout,
                                                                                              init_seed))
        self._mtp_hidden = None  # the final hidden states of a training forward, for the MTP loss
        self.checkpoint_fn = None  # set by the training wiring, e.g. deepspeed.checkpointing.checkpoint

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [b, s, h] of the whole sequence (for replicated consumers, e.g. a
        classification head: under sequence parallelism they are gathered, the gradient split)."""
        h = self._local_hidden_states(input_ids)
        if self.layout.sequence_parallel:
            h = gather_from_sequence_parallel_region(h, 1, tensor_parallel_output_grad=False)
        return gather_from_context_parallel_region(h)

    def _local_hidden_states(self, input_ids: torch.Tensor, cache=None, documents=None) -> torch.Tensor:
        """Final-normed hidden states: [b, s, h], or this rank's [b, s / tp, h] under sequence parallelism.
        ``documents``: packed rows, each document attending only to itself (``models.documents``)."""
        if documents is not None:
            return self.final_norm(documents.layers_output(self, input_ids))
        h = self.embedding(input_ids, None if cache is None else cache.positions)
        for i, layer in enumerate(self.layers):
            if cache is not None:
                h = layer(h, cache.layer(i))
            elif self.checkpoint_fn is not None and self.training and not isinstance(layer.mlp, MoEMLP):
                # (an MoE layer is not recomputed: its auxiliary loss must keep the graph of this forward)
                h = self.checkpoint_fn(layer, h)
            else:
                h = layer(h)
        h = self.final_norm(h)
        if self.mtp is not None and self.training and cache is None:
            self._mtp_hidden = h
        return h

    def parallel_logits(self, input_ids: torch.Tensor, cache=None, documents=None) -> torch.Tensor:
        """This rank's vocabulary slice of the logits [b, s, padded_vocab / tp]. With a ``models.kv_cache.KVCache``
        (on which ``read`` was called for these tokens): the tokens continue the cached ones, and only the last
        position's logits [b, 1, padded_vocab / tp] come back (what decoding reads)."""
        if cache is not None and cp_world_size() > 1:
            raise ValueError("decoding with a KV cache is not implemented under context parallelism")
        h = self._local_hidden_states(input_ids, cache, documents)
        if cache is not None:
            h = h[:, -1:]
        return self.embedding.logits(h) if self.lm_head is None else self.lm_head(h)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, label_smoothing: float = 0.0,
                reduction: str = "mean", documents=None):
        """Full logits [b, s, vocab] without labels; the cross-entropy with (shifted) labels, plus, in training
        with a mean reduction, the MoE layers' auxiliary losses (``moe_aux_loss``). ``reduction``: mean, sum, none
        (per token) or row_sum (each row's sum, [b]: what the tiled loss can give per row). ``documents``: packed
        rows' boundaries (``models.documents.DocumentAttention``)."""
        if reduction == "row_sum" and labels is not None and self.layout.tiled_loss == 1:
            return self._forward(input_ids, labels, label_smoothing, "none", documents).sum(dim=1)
        out = self._forward(input_ids, labels, label_smoothing, reduction, documents)
        if labels is not None and self.training and reduction == "mean" and self.config.num_experts:
            out = out + self.moe_aux_loss()
        if labels is not None and self.training and reduction == "mean" and self.mtp is not None:
            out = out + self.mtp_loss(input_ids, labels)
        return out

    def mtp_loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """lambda x the MTP depths' mean cross-entropy (+ their MoE layers' auxiliary losses), from the hidden
        states of the training forward just run."""
        hidden, self._mtp_hidden = self._mtp_hidden, None
        if self.layout.tiled_loss > 1:  # each depth's output layer and loss tiled as the main one's
            depths = self.mtp.hidden_states(hidden, input_ids, self.embedding.word_embeddings)
            loss = torch.stack([self._tiled_cross_entropy(h, shifted(labels, k, -100))
                                for k, h in enumerate(depths, start=1)]).mean()
        else:
            head = self.embedding.logits if self.lm_head is None else self.lm_head
            loss = self.mtp.loss(hidden, input_ids, labels, self.embedding.word_embeddings, head)
        return self.config.mtp_loss_scaling_factor * loss + self.mtp.moe_aux_loss()

    def moe_aux_loss(self) -> torch.Tensor | float:
        """The sum over MoE layers of coeff x load-balancing loss (+ z-loss) of the last forward (0.0: none)."""
        return sum(layer.mlp.aux_loss for layer in self.layers
                   if isinstance(layer.mlp, MoEMLP) and layer.mlp.aux_loss is not None)

    def _forward(self, input_ids, labels, label_smoothing: float, reduction: str, documents=None):
        if labels is not None and self.layout.tiled_loss > 1:
            return self._tiled_loss(input_ids, labels, label_smoothing, reduction, documents)
        logits = self.parallel_logits(input_ids, documents=documents)
        if labels is None:
            return gather_from_context_parallel_region(gather_vocab_logits(logits, self.config.vocab_size))
        chunk = self.layout.loss_chunk_tokens or None  # (--loss-chunk-tokens: the fp32 work one chunk's at a time)
        if cp_world_size() > 1:
            return context_parallel_cross_entropy(logits, labels, self.config.vocab_size, label_smoothing, reduction,
                                                  chunk_tokens=chunk)
        return vocab_parallel_cross_entropy(logits, labels, vocab_size=self.config.vocab_size,
                                            label_smoothing=label_smoothing, reduction=reduction, chunk_tokens=chunk)

    def _tiled_loss(self, input_ids, labels, label_smoothing: float, reduction: str, documents=None) -> torch.Tensor:
        """ALST's tiled output layer and loss (models/tiling.py): the [s, V / tp] logits are never held whole."""
        if reduction not in ("mean", "sum", "row_sum"):
            raise ValueError(f"the tiled loss reduces to a mean, a sum or each row's sum, not {reduction!r}")
        return self._tiled_cross_entropy(self._local_hidden_states(input_ids, documents=documents), labels,
                                         label_smoothing, reduction)

    def _tiled_cross_entropy(self, h: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0,
                             reduction: str = "mean") -> torch.Tensor:
        """The tiled loss of final-normed hidden states ``h`` as the layers give them (this rank's chunk under
        sequence or context parallelism) against the whole sequence's ``labels``."""
        labels = context_chunk(labels)
        if self.layout.sequence_parallel:  # the tiles take the whole chunk (replicated over TP, as hidden_states)
            h = gather_from_sequence_parallel_region(h, 1, tensor_parallel_output_grad=False)
        head = self.embedding if self.lm_head is None else self.lm_head
        logits_fn = self.embedding.logits if self.lm_head is None else self.lm_head
        if reduction == "row_sum":
            if label_smoothing:
                raise ValueError("the tiled loss sums rows without label smoothing")
            return reduce_from_context_parallel_region(tiled_row_cross_entropy(
                lambda x: logits_fn(x, sequence_split=False), head.parameters(), h, labels,
                vocab_size=self.config.vocab_size, tiles=self.layout.tiled_loss,
                chunk_tokens=self.layout.loss_chunk_tokens or None))
        total = reduce_from_context_parallel_region(tiled_cross_entropy(
            lambda x: logits_fn(x, sequence_split=False), head.parameters(), h, labels,
            vocab_size=self.config.vocab_size, tiles=self.layout.tiled_loss, label_smoothing=label_smoothing,
            chunk_tokens=self.layout.loss_chunk_tokens or None))
        return total if reduction == "sum" else total / global_count(labels != -100).clamp(min=1)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation (no KV cache: for evaluation and tests, not serving)."""
        for _ in range(max_new_tokens):
            context = input_ids[:, -self.config.max_sequence_length:]
            nxt = self(context)[:, -1].argmax(-1, keepdim=True)
            input_ids = torch.cat([input_ids, nxt], dim=1)
        return input_ids
