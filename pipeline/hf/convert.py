"""Weight and config mapping between the project's GPT and Hugging Face's GPT-2, Llama, Qwen2, Qwen3, Mistral,
Mixtral, Qwen3-MoE, Qwen2-MoE and DeepSeek-V3.

Pure functions on *full* (TP=1) state dicts: ``to_hf`` and ``from_hf`` never see a
process group. Sharding to a tensor-parallel size happens afterwards, with
``pipeline.checkpoints.state_dicts.load_full_state_dict``.

One table (``weight_map``) lists, for a given config, every project tensor, its full
shape and the Hugging Face tensor(s) it is made of; both directions read it, so an
export and an import cannot disagree. The two conventions differ in only four ways:

* fused tensors: the project keeps Q, K, V (and llama's gate, up) as row blocks of
  one matrix, in Hugging Face's head order; Llama stores them as separate matrices,
  GPT-2 stores QKV fused too (``c_attn``);
* GPT-2's ``Conv1D`` stores a linear weight as [in, out], the transpose of ``nn.Linear``;
* a tied output layer has no tensor of its own in the project's state dict;
* DeepSeek-V3 (``rope_interleave``, its default) rotates interleaved pairs of the RoPE rows of the query and
  ``kv_a_proj_with_mqa``; the project's latent attention rotates halves: those rows are reordered [even; odd] on
  import and back on export (``models.deepseek.deinterleave_rope_rows``), the same function bit for bit.

DeepSeek-V3's multi-token prediction modules are where its checkpoints keep them, ``model.layers.{L + d}.*``
(``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and one decoder layer, L = ``num_hidden_layers``), which
``DeepseekV3ForCausalLM`` does not load and transformers' ``MtpModel.from_pretrained`` does: an import keeps the
depths the files hold (``mtp_num_layers``; none in what ``save_pretrained`` writes), an export writes the model's.
The copies of the embedding and output layer some checkpoints give each depth (``embed_tokens``,
``shared_head.head``) are checked equal to the model's on import and not written on export (the project shares
them, as ``MtpModel`` does).

The Hugging Face families are one table, ``HF_FAMILIES`` (at the end of the config readers): each entry
names its classes, reads its config into the project's (Qwen2, Qwen3 and Mistral are options of the llama
variant: ``qkv_bias``, ``qk_norm``, ``sliding_window``; Mixtral and Qwen3-MoE add the MoE fields, and name their
experts' tensors with ``pipeline.hf.experts``) and writes it back; ``GPTConfig.hf_model_type`` records the family
an import came from, so that it exports as that family again.

What a Hugging Face config can express and the project's model cannot (RoPE scaling,
other activations, partial rotary, ...) is refused with the field named, never
silently approximated: a conversion that "works" but changes the function is the bug
this module exists to prevent.
"""
from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from models.config import ConfigError, GPTConfig
from models.deepseek import deinterleave_rope_rows, interleave_rope_rows
from pipeline.job.arguments import DTYPE_CHOICES, add_dtype_arg  # noqa: F401 (re-exported)
from pipeline.job.errors import UserError
from pipeline.hf.experts import (DEEPSEEK_V3_EXPERTS, MIXTRAL_EXPERTS, QWEN2_MOE_EXPERTS, QWEN3_MOE_EXPERTS,
                                 ExpertNames, is_fused, unfuse_experts)
from pipeline.hf.safetensors_io import (PlannedTensor, SafetensorsFiles, dtype_of, hf_weight_files, materialize,
                                       read_header, shape_of)

GPT2_ARCH = "GPT2LMHeadModel"
LLAMA_ARCH = "LlamaForCausalLM"
# Activations computing exactly the project's GELU (tanh approximation): the formula and torch's kernel.
_GPT2_TANH_GELUS = {"gelu_new", "gelu_pytorch_tanh"}
_SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Training settings a Hugging Face config has no field for (Llama has no hidden dropout, neither has a
# vocabulary padding): kept under this key of config.json so that project -> HF -> project is lossless.
TRAINING_KEY = "megatron_ds_training"
_TRAINING_FIELDS = ("hidden_dropout", "attention_dropout", "seq_length", "make_vocab_size_divisible_by")
# an MoE model's training-only routing settings (evaluation is dropless, the z-loss only trains the router)
_MOE_TRAINING_FIELDS = ("moe_z_loss_coeff", "moe_capacity_factor", "moe_min_capacity", "moe_aux_loss_coeff",
                        "moe_router_load_balancing_type", "moe_router_bias_update_rate", "moe_grouped_gemm",
                        "mtp_loss_scaling_factor")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


SHORT_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def short_dtype_name(name: str) -> str:
    """'fp32', 'bf16' or 'fp16' for any of the ``DTYPE_CHOICES``."""
    return SHORT_DTYPE_NAMES[DTYPES[name]]


class ConversionError(UserError, ValueError):
    """A model, config or state dict that cannot be converted exactly (the message says which field or tensor)."""


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ConversionError(f"unknown dtype {name!r}; choose one of float32, float16, bfloat16") from None


def dtype_name(dtype) -> str:
    """'bfloat16' for torch.bfloat16 (or for the string transformers keeps in a config)."""
    return str(dtype).removeprefix("torch.")


# -- the weight table --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightRule:
    ours: str                      # project parameter name
    shape: tuple[int, ...]         # its full (TP=1) shape
    theirs: tuple[str, ...]        # Hugging Face tensor(s): several = row blocks of ``ours``, in order
    split: tuple[int, ...] = ()    # row counts of those blocks (when there are several)
    transpose: bool = False        # GPT-2 Conv1D: the HF tensor is ours transposed ([in, out])
    rope: tuple[int, int] = ()     # (RoPE rows, period): every period rows end with RoPE rows interleaved in HF's


def weight_map(config: GPTConfig) -> list[WeightRule]:
    """Every tensor of the project's full state dict for ``config`` and where it lives in Hugging Face's."""
    return _gpt2_map(config) if config.variant == "gpt2" else _llama_map(config)


def _gpt2_map(c: GPTConfig) -> list[WeightRule]:
    h, f, V = c.hidden_size, c.ffn_hidden_size, c.vocab_size
    R = WeightRule
    rules = [R("embedding.word_embeddings.weight", (V, h), ("transformer.wte.weight",)),
             R("embedding.position_embeddings.weight", (c.max_position_embeddings, h), ("transformer.wpe.weight",))]
    for i in range(c.num_layers):
        p, t = f"layers.{i}.", f"transformer.h.{i}."
        rules += [R(p + "input_norm.weight", (h,), (t + "ln_1.weight",)),
                  R(p + "input_norm.bias", (h,), (t + "ln_1.bias",)),
                  R(p + "attention.qkv.weight", (3 * h, h), (t + "attn.c_attn.weight",), transpose=True),
                  R(p + "attention.dense.weight", (h, h), (t + "attn.c_proj.weight",), transpose=True),
                  R(p + "post_attention_norm.weight", (h,), (t + "ln_2.weight",)),
                  R(p + "post_attention_norm.bias", (h,), (t + "ln_2.bias",)),
                  R(p + "mlp.fc_in.weight", (f, h), (t + "mlp.c_fc.weight",), transpose=True),
                  R(p + "mlp.fc_out.weight", (h, f), (t + "mlp.c_proj.weight",), transpose=True)]
        if c.bias:
            rules += [R(p + "attention.qkv.bias", (3 * h,), (t + "attn.c_attn.bias",)),
                      R(p + "attention.dense.bias", (h,), (t + "attn.c_proj.bias",)),
                      R(p + "mlp.fc_in.bias", (f,), (t + "mlp.c_fc.bias",)),
                      R(p + "mlp.fc_out.bias", (h,), (t + "mlp.c_proj.bias",))]
    rules += [R("final_norm.norm.weight", (h,), ("transformer.ln_f.weight",)),
              R("final_norm.norm.bias", (h,), ("transformer.ln_f.bias",))]
    return rules


def _gpt2_bias_names(c: GPTConfig) -> dict[str, int]:
    """GPT-2's Conv1D always has a bias: a bias-free project model exports zeros there (exactly the same function)."""
    h, f = c.hidden_size, c.ffn_hidden_size
    out = {}
    for i in range(c.num_layers):
        t = f"transformer.h.{i}."
        out.update({t + "attn.c_attn.bias": 3 * h, t + "attn.c_proj.bias": h, t + "mlp.c_fc.bias": f,
                    t + "mlp.c_proj.bias": h})
    return out


def _llama_map(c: GPTConfig) -> list[WeightRule]:
    h, V = c.hidden_size, c.vocab_size
    R = WeightRule
    rules = [R("embedding.word_embeddings.weight", (V, h), ("model.embed_tokens.weight",))]
    for i in range(c.num_layers):
        rules += _layer_rules(c, f"layers.{i}.", f"model.layers.{i}.", c.is_moe_layer(i))
    rules.append(R("final_norm.norm.weight", (h,), ("model.norm.weight",)))
    if not c.tie_embeddings:
        rules.append(R("lm_head.weight", (V, h), ("lm_head.weight",)))
    for d in range(c.mtp_num_layers):
        p, t = f"mtp.layers.{d}.", f"model.layers.{c.num_layers + d}."
        rules += [R(p + "enorm.weight", (h,), (t + "enorm.weight",)),
                  R(p + "hnorm.weight", (h,), (t + "hnorm.weight",)),
                  R(p + "eh_proj.weight", (h, 2 * h), (t + "eh_proj.weight",)),
                  R(p + "final_norm.weight", (h,), (t + "shared_head.norm.weight",))]
        rules += _layer_rules(c, p + "block.", t, c.num_experts > 0)  # an MoE layer where the model has experts
    return rules


def _layer_rules(c: GPTConfig, p: str, t: str, moe: bool) -> list[WeightRule]:
    """One decoder layer: the project's names start with ``p``, Hugging Face's with ``t``."""
    h, f, d = c.hidden_size, c.ffn_hidden_size, c.head_dim
    q, kv = c.num_heads * d, c.num_kv_heads * d
    R = WeightRule
    qkv = tuple(t + f"self_attn.{n}_proj" for n in "qkv")
    gate_up = (t + "mlp.gate_proj", t + "mlp.up_proj")
    rules = [R(p + "input_norm.weight", (h,), (t + "input_layernorm.weight",)),
             R(p + "post_attention_norm.weight", (h,), (t + "post_attention_layernorm.weight",))]
    if c.multi_latent_attention:
        rules += _latent_attention_rules(c, p + "attention.", t + "self_attn.")
    else:
        rules += [R(p + "attention.qkv.weight", (q + 2 * kv, h), tuple(n + ".weight" for n in qkv), (q, kv, kv)),
                  R(p + "attention.dense.weight", (h, q), (t + "self_attn.o_proj.weight",))]
    if moe:
        rules += _expert_rules(c, p, t)
    else:
        rules += [R(p + "mlp.fc_in.weight", (2 * f, h), tuple(n + ".weight" for n in gate_up), (f, f)),
                  R(p + "mlp.fc_out.weight", (h, f), (t + "mlp.down_proj.weight",))]
    if c.qk_norm:
        rules += [R(p + f"attention.{n}_norm.weight", (d,), (t + f"self_attn.{n}_norm.weight",)) for n in "qk"]
    if c.bias or c.qkv_bias:
        rules.append(R(p + "attention.qkv.bias", (q + 2 * kv,), tuple(n + ".bias" for n in qkv), (q, kv, kv)))
    if c.bias:
        rules += [R(p + "attention.dense.bias", (h,), (t + "self_attn.o_proj.bias",)),
                  R(p + "mlp.fc_in.bias", (2 * f,), tuple(n + ".bias" for n in gate_up), (f, f)),
                  R(p + "mlp.fc_out.bias", (h,), (t + "mlp.down_proj.bias",))]
    return rules


def rope_interleaved(c: GPTConfig) -> bool:
    """Whether the Hugging Face side of a latent-attention model keeps its RoPE rows interleaved: as the import
    recorded (``rope_interleave``), else DeepSeek-V3's default (true)."""
    recorded = c.extra.get("hf", {}) if isinstance(c.extra, dict) else {}
    return bool(recorded.get("rope_interleave", True))


def _latent_attention_rules(c: GPTConfig, a: str, s: str) -> list[WeightRule]:
    """Multi-head latent attention (``models.deepseek``; transformers' ``DeepseekV3Attention``)."""
    h, heads, rope, rank = c.hidden_size, c.num_heads, c.qk_rope_head_dim, c.kv_lora_rank
    qk = c.qk_nope_head_dim + rope
    q_rope, kv_rope = ((rope, qk), (rope, rank + rope)) if rope_interleaved(c) else ((), ())
    R = WeightRule
    if c.q_lora_rank is None:
        rules = [R(a + "q_proj.weight", (heads * qk, h), (s + "q_proj.weight",), rope=q_rope)]
    else:
        rules = [R(a + "q_a_proj.weight", (c.q_lora_rank, h), (s + "q_a_proj.weight",)),
                 R(a + "q_a_norm.weight", (c.q_lora_rank,), (s + "q_a_layernorm.weight",)),
                 R(a + "q_b_proj.weight", (heads * qk, c.q_lora_rank), (s + "q_b_proj.weight",), rope=q_rope)]
    return rules + [
        R(a + "kv_a_proj.weight", (rank + rope, h), (s + "kv_a_proj_with_mqa.weight",), rope=kv_rope),
        R(a + "kv_a_norm.weight", (rank,), (s + "kv_a_layernorm.weight",)),
        R(a + "kv_b_proj.weight", (heads * (c.qk_nope_head_dim + c.v_head_dim), rank), (s + "kv_b_proj.weight",)),
        R(a + "dense.weight", (h, heads * c.v_head_dim), (s + "o_proj.weight",))]


def _expert_rules(c: GPTConfig, p: str, t: str) -> list[WeightRule]:
    """An MoE layer's router and experts (DeepSpeed's names: ``mlp.moe.deepspeed_moe``) and their names in the
    files of the config's Hugging Face family (``pipeline.hf.experts``)."""
    h, f, E = c.hidden_size, c.moe_ffn_hidden_size or c.ffn_hidden_size, c.num_experts
    names, ours = hf_family(c).experts, p + "mlp.moe.deepspeed_moe."
    rules = [WeightRule(ours + "gate.wg.weight", (E, h), (names.router(t),))]
    for e in range(E):
        x = f"{ours}experts.deepspeed_experts.{e}."
        gate, up, down = names.expert(t, e)
        rules += [WeightRule(x + "fc_in.weight", (2 * f, h), (gate, up), (f, f)),
                  WeightRule(x + "fc_out.weight", (h, f), (down,))]
    if c.moe_router_enable_expert_bias:
        rules.append(WeightRule(ours + "gate.balance_bias", (E,), (names.router_bias(t),)))
    shared = c.moe_shared_expert_intermediate_size
    if shared is not None:
        gate, up, down = names.shared_expert(t)
        rules += [WeightRule(p + "mlp.shared_expert.fc_in.weight", (2 * shared, h), (gate, up), (shared, shared)),
                  WeightRule(p + "mlp.shared_expert.fc_out.weight", (h, shared), (down,))]
    if c.moe_shared_expert_gate:
        rules.append(WeightRule(p + "mlp.shared_expert_gate.weight", (1, h), (names.shared_expert_gate(t),)))
    return rules


# -- project -> Hugging Face ----------------------------------------------------------------------------------------

def hf_config(config: GPTConfig, dtype: torch.dtype | None = None, special_tokens: Mapping | None = None):
    """The ``transformers`` config of the Hugging Face model computing the same function as ``config``, in the
    family ``hf_family(config)`` (a config that family cannot hold is refused).

    ``special_tokens`` (bos/eos/pad ids) override those an import recorded in ``config.extra["hf"]``.
    """
    recorded = dict(config.extra.get("hf", {})) if isinstance(config.extra, dict) else {}
    tokens = {k: recorded.get(k) for k in _SPECIAL_TOKENS}
    tokens.update({k: v for k, v in (special_tokens or {}).items() if k in _SPECIAL_TOKENS})
    # here, not at the top: the dtype helpers of this module serve commands without transformers
    import transformers  # noqa: PLC0415
    family = hf_family(config)
    cfg = getattr(transformers, family.config_class)(**family.write(config), **tokens)
    cfg.architectures = [family.architecture]
    record = {k: getattr(config, k) for k in _TRAINING_FIELDS + (_MOE_TRAINING_FIELDS if config.num_experts else ())}
    if config.variant == "gpt2" and not config.bias:
        record["bias"] = False  # GPT-2 in transformers always has biases: these are exported as zeros
    setattr(cfg, TRAINING_KEY, record)
    if dtype is not None:
        cfg.dtype = dtype
    return cfg


def _gpt2_config_to_hf(config: GPTConfig) -> dict:
    return dict(
        vocab_size=config.vocab_size, n_positions=config.max_position_embeddings, n_embd=config.hidden_size,
        n_layer=config.num_layers, n_head=config.num_heads, n_inner=config.ffn_hidden_size,
        activation_function="gelu_new", resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout, layer_norm_epsilon=config.norm_eps,
        initializer_range=config.init_std, tie_word_embeddings=True)


def _decoder_config_to_hf(config: GPTConfig) -> dict:
    """The config fields Llama, Qwen2, Qwen3 and Mistral share."""
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.init_std,
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
        attention_dropout=config.attention_dropout)


def _llama_config_to_hf(config: GPTConfig) -> dict:
    return dict(_decoder_config_to_hf(config), attention_bias=config.bias, mlp_bias=config.bias)


def _qwen2_config_to_hf(config: GPTConfig) -> dict:
    out = dict(_decoder_config_to_hf(config), use_sliding_window=False)
    if config.head_dim == config.hidden_size // config.num_heads:
        del out["head_dim"]  # Qwen2Config has no such field (its attention reads one when it is there)
    return out


def _qwen3_config_to_hf(config: GPTConfig) -> dict:
    return dict(_decoder_config_to_hf(config), use_sliding_window=False, attention_bias=False)


def _mistral_config_to_hf(config: GPTConfig) -> dict:
    return dict(_decoder_config_to_hf(config), sliding_window=config.sliding_window)


def _mixtral_config_to_hf(config: GPTConfig) -> dict:
    default_head = config.head_dim == config.hidden_size // config.num_heads  # MixtralConfig keeps None there
    return dict(_decoder_config_to_hf(config), sliding_window=config.sliding_window,
                head_dim=None if default_head else config.head_dim,
                intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
                num_local_experts=config.num_experts, num_experts_per_tok=config.moe_top_k,
                router_aux_loss_coef=config.moe_aux_loss_coeff, router_jitter_noise=0.0)


def _qwen_moe_fields_to_hf(config: GPTConfig) -> dict:
    """The MoE fields Qwen3-MoE and Qwen2-MoE share."""
    return dict(moe_intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
                num_experts=config.num_experts, num_experts_per_tok=config.moe_top_k,
                norm_topk_prob=config.moe_norm_topk_prob, decoder_sparse_step=config.moe_layer_freq,
                mlp_only_layers=list(config.moe_dense_layers), router_aux_loss_coef=config.moe_aux_loss_coeff)


def _qwen3_moe_config_to_hf(config: GPTConfig) -> dict:
    return dict(_qwen3_config_to_hf(config), **_qwen_moe_fields_to_hf(config))


def _qwen2_moe_config_to_hf(config: GPTConfig) -> dict:
    return dict(_qwen2_config_to_hf(config), **_qwen_moe_fields_to_hf(config), qkv_bias=config.qkv_bias,
                shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size)


def _deepseek_v3_config_to_hf(c: GPTConfig) -> dict:
    out = dict(_decoder_config_to_hf(c), moe_intermediate_size=c.moe_ffn_hidden_size or c.ffn_hidden_size,
               n_routed_experts=c.num_experts, num_experts_per_tok=c.moe_top_k, n_group=c.moe_router_num_groups or 1,
               topk_group=c.moe_router_group_topk or 1, routed_scaling_factor=c.moe_router_topk_scaling_factor,
               norm_topk_prob=c.moe_norm_topk_prob, first_k_dense_replace=len(c.moe_dense_layers),
               n_shared_experts=c.moe_shared_expert_intermediate_size // (c.moe_ffn_hidden_size or c.ffn_hidden_size),
               q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
               qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, rope_interleave=rope_interleaved(c),
               attention_bias=False, num_mtp_layers=c.mtp_num_layers)
    del out["head_dim"]  # DeepseekV3Config derives it (qk_rope_head_dim)
    return out


def to_hf(full_state_dict: Mapping[str, torch.Tensor], config: GPTConfig, dtype: torch.dtype | str | None = None,
          special_tokens: Mapping | None = None, *, lazy: bool = False):
    """(Hugging Face config, Hugging Face state dict) of the project model ``(config, full_state_dict)``.

    ``dtype`` casts every tensor (None keeps them as they are); a cast that overflows (fp16) is refused.
    A tied model's state dict has no ``lm_head.weight``: transformers ties it on load. ``lazy``: the values
    are ``PlannedTensor``s, each made (read, cut, cast) only when ``pipeline.hf.safetensors_io`` writes it, so an
    export holds the source and one tensor, not a second model.
    """
    dtype = parse_dtype(dtype)
    hf_family(config)  # a model no transformers class holds (GPT-2 with MoE layers): said so, not as missing keys
    rules = weight_map(config)
    _check_keys(full_state_dict, rules, "project state dict")
    source_dtypes = set()
    out: dict[str, PlannedTensor] = {}
    for rule in rules:
        got = shape_of(full_state_dict, rule.ours)
        if got != rule.shape:
            raise ConversionError(f"project state dict: {rule.ours} has shape {got}, the config expects {rule.shape}")
        src_dtype = dtype_of(full_state_dict, rule.ours)
        source_dtypes.add(src_dtype)
        rows = list(rule.split) if rule.split else [rule.shape[0]]
        start = 0
        for name, n in zip(rule.theirs, rows):
            shape = (n, *rule.shape[1:])
            shape = tuple(reversed(shape)) if rule.transpose else shape
            out[name] = PlannedTensor(shape, dtype or src_dtype,
                                      _piece_maker(full_state_dict, rule, start, n, dtype))
            start += n
    if config.variant == "gpt2" and not config.bias:
        like = dtype or dtype_of(full_state_dict, "embedding.word_embeddings.weight")
        out.update({name: PlannedTensor((n,), like, lambda n=n, like=like: torch.zeros(n, dtype=like))
                    for name, n in _gpt2_bias_names(config).items()})
    common = dtype if dtype is not None else (source_dtypes.pop() if len(source_dtypes) == 1 else torch.float32)
    cfg = hf_config(config, common, special_tokens)
    return cfg, (out if lazy else {name: planned.make() for name, planned in out.items()})


def _piece_maker(full_state_dict: Mapping, rule: WeightRule, start: int, rows: int, dtype):
    def make() -> torch.Tensor:
        piece = materialize(full_state_dict[rule.ours]).narrow(0, start, rows)
        piece = piece.t() if rule.transpose else piece
        piece = interleave_rope_rows(piece, *rule.rope) if rule.rope else piece
        # a block of a fused tensor gets its own storage: safetensors' own writer refuses tensors sharing one
        piece = piece.clone(memory_format=torch.contiguous_format) if rule.split else piece.contiguous()
        return _cast(piece, dtype, rule.ours)
    return make


def _cast(t: torch.Tensor, dtype: torch.dtype | None, name: str) -> torch.Tensor:
    if dtype is None or t.dtype == dtype:
        return t
    cast = t.to(dtype)
    if dtype.is_floating_point and not torch.isfinite(cast).all() and torch.isfinite(t).all():
        worst = t.abs().max().item()
        raise ConversionError(f"{name} has values up to {worst:.3g}, out of range for {dtype_name(dtype)}; "
                              f"export in bfloat16 or float32 instead")
    return cast


def _check_keys(sd: Mapping, rules: list[WeightRule], source: str) -> None:
    want = {r.ours for r in rules}
    missing = sorted(want - set(sd), key=_natural)
    unexpected = sorted(set(sd) - want, key=_natural)
    if missing or unexpected:
        parts = [f"{source} does not match its config"]
        if missing:
            parts.append(f"missing: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            parts.append(f"unexpected: {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
        raise ConversionError("; ".join(parts))


def _natural(name: str):
    return [int(s) if s.isdigit() else s for s in name.split(".")]


# -- Hugging Face -> project ----------------------------------------------------------------------------------------

def config_from_hf(cfg, source: str = "Hugging Face config") -> GPTConfig:
    """The project config computing the same function as a Hugging Face config of one of ``HF_FAMILIES``,
    or a clear refusal."""
    model_type = getattr(cfg, "model_type", None)
    family = HF_FAMILIES.get(model_type)
    if family is None:
        supported = ", ".join(f"{f.architecture} (model_type {f.model_type!r})" for f in HF_FAMILIES.values())
        raise ConversionError(
            f"{source}: model_type {model_type!r} "
            f"({', '.join(getattr(cfg, 'architectures', None) or []) or 'no architecture'}) "
            f"is not supported; supported: {supported}")
    archs = getattr(cfg, "architectures", None) or []
    unknown = [a for a in archs if a not in family.accepted]
    if unknown:
        raise ConversionError(f"{source}: architecture {', '.join(unknown)} is not supported; "
                              f"supported for model_type {model_type!r}: {family.architecture}")
    hf_meta = {"architecture": family.architecture, "source": source}
    hf_meta.update({k: getattr(cfg, k, None) for k in _SPECIAL_TOKENS})
    try:
        training = getattr(cfg, TRAINING_KEY, None) or {}
        out = family.read(cfg, source)
        if model_type == "gpt2":
            out["bias"] = training.get("bias", True) is not False  # from_hf checks the biases are still zero
        if model_type == "deepseek_v3":  # the layout of the RoPE rows in the files (rope_interleaved)
            hf_meta["rope_interleave"] = bool(getattr(cfg, "rope_interleave", True))
        out.update({k: training[k] for k in _TRAINING_FIELDS + _MOE_TRAINING_FIELDS if k in training})
        return GPTConfig(**out, hf_model_type=model_type, extra={"hf": hf_meta})
    except ConfigError as e:
        raise ConversionError(f"{source}: {e}") from None


def _refuse(source: str, field: str, value, wanted: str):
    raise ConversionError(f"{source}: {field}={value!r} cannot be represented by the project's model ({wanted})")


def _gpt2_config_from_hf(cfg, source: str) -> dict:
    act = cfg.activation_function
    if act not in _GPT2_TANH_GELUS:
        _refuse(source, "activation_function", act, "it uses GELU with the tanh approximation: gelu_new")
    if not getattr(cfg, "scale_attn_weights", True):
        _refuse(source, "scale_attn_weights", False, "attention scores are always scaled by 1/sqrt(head_dim)")
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
        _refuse(source, "scale_attn_by_inverse_layer_idx", True, "no per-layer attention scaling")
    if getattr(cfg, "add_cross_attention", False):
        _refuse(source, "add_cross_attention", True, "a decoder-only model")
    if getattr(cfg, "tie_word_embeddings", True) is False:
        _refuse(source, "tie_word_embeddings", False, "the gpt2 variant ties input and output embeddings")
    return dict(variant="gpt2", vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, num_layers=cfg.n_layer,
                num_heads=cfg.n_head, ffn_hidden_size=cfg.n_inner or 4 * cfg.n_embd,
                max_position_embeddings=cfg.n_positions, norm_eps=float(cfg.layer_norm_epsilon),
                hidden_dropout=float(cfg.resid_pdrop), attention_dropout=float(cfg.attn_pdrop),
                init_std=float(cfg.initializer_range), bias=True, tie_embeddings=True)


def _rope_theta(cfg, source: str) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    if getattr(cfg, "rope_scaling", None) and not rope:  # transformers 4.x configs
        rope = dict(cfg.rope_scaling)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        _refuse(source, "rope_type", rope_type, "plain RoPE without scaling (rope_type 'default')")
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        _refuse(source, "partial_rotary_factor", partial, "RoPE over the whole head")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise ConversionError(f"{source}: no rope_theta in the config")
    return float(theta)


def _decoder_config_from_hf(cfg, source: str) -> dict:
    """The fields Llama, Qwen2, Qwen3 and Mistral configs share, as the project's llama variant."""
    if cfg.hidden_act != "silu":
        _refuse(source, "hidden_act", cfg.hidden_act, "SwiGLU with silu")
    return dict(variant="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                ffn_hidden_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
                norm_eps=float(cfg.rms_norm_eps), rope_theta=_rope_theta(cfg, source), hidden_dropout=0.0,
                attention_dropout=float(cfg.attention_dropout or 0.0), init_std=float(cfg.initializer_range),
                tie_embeddings=bool(cfg.tie_word_embeddings))


def _llama_config_from_hf(cfg, source: str) -> dict:
    attention_bias, mlp_bias = bool(cfg.attention_bias), bool(getattr(cfg, "mlp_bias", False))
    if attention_bias != mlp_bias:
        _refuse(source, "attention_bias/mlp_bias", (attention_bias, mlp_bias),
                "one bias setting for attention and MLP alike")
    return dict(_decoder_config_from_hf(cfg, source), bias=attention_bias)


def _full_attention_only(cfg, source: str) -> None:
    """Qwen's sliding window applies to some layers only: refused (Mistral's one window is ``sliding_window``)."""
    if getattr(cfg, "use_sliding_window", False):
        _refuse(source, "use_sliding_window", True, "full causal attention in every layer")
    partial = [t for t in getattr(cfg, "layer_types", None) or [] if t != "full_attention"]
    if partial:
        _refuse(source, "layer_types", partial[0], "full causal attention in every layer")


def _qwen2_config_from_hf(cfg, source: str) -> dict:
    _full_attention_only(cfg, source)
    return dict(_decoder_config_from_hf(cfg, source), bias=False, qkv_bias=True)


def _qwen3_config_from_hf(cfg, source: str) -> dict:
    _full_attention_only(cfg, source)
    if getattr(cfg, "attention_bias", False):
        _refuse(source, "attention_bias", True, "a Qwen3 model without attention biases")
    return dict(_decoder_config_from_hf(cfg, source), bias=False, qk_norm=True)


def _mistral_config_from_hf(cfg, source: str) -> dict:
    # GPTConfig refuses a window shorter than the sequence length (full attention would not equal it there).
    return dict(_decoder_config_from_hf(cfg, source), bias=False, sliding_window=cfg.sliding_window)


def _mixtral_config_from_hf(cfg, source: str) -> dict:
    """Mixtral: Mistral's attention, every layer a mixture of ``num_local_experts`` SwiGLU experts (routing:
    softmax, top-k, renormalised; dropless), the load-balancing loss ``router_aux_loss_coef``."""
    if float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0) != 0.0:
        _refuse(source, "router_jitter_noise", cfg.router_jitter_noise, "0 (no multiplicative jitter)")
    return dict(_mistral_config_from_hf(cfg, source), num_experts=cfg.num_local_experts,
                moe_top_k=cfg.num_experts_per_tok, moe_ffn_hidden_size=cfg.intermediate_size,
                moe_aux_loss_coeff=float(cfg.router_aux_loss_coef), moe_norm_topk_prob=True, moe_layer_freq=1)


def _qwen_moe_fields_from_hf(cfg, source: str, dense: str) -> dict:
    """The MoE fields Qwen3-MoE and Qwen2-MoE share: every ``decoder_sparse_step``-th layer not in
    ``mlp_only_layers`` a mixture of ``num_experts`` SwiGLU experts of ``moe_intermediate_size`` (softmax, top-k,
    renormalised if ``norm_topk_prob``; dropless), the others a dense SwiGLU of ``intermediate_size``."""
    if not cfg.num_experts:
        _refuse(source, "num_experts", cfg.num_experts, f"an MoE model (import a dense model as {dense})")
    return dict(num_experts=cfg.num_experts, moe_top_k=cfg.num_experts_per_tok,
                moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_aux_loss_coeff=float(cfg.router_aux_loss_coef),
                moe_norm_topk_prob=bool(cfg.norm_topk_prob), moe_layer_freq=cfg.decoder_sparse_step,
                moe_dense_layers=list(cfg.mlp_only_layers or []))


def _qwen3_moe_config_from_hf(cfg, source: str) -> dict:
    """Qwen3-MoE: Qwen3's attention, Qwen's MoE layers without a shared expert."""
    return dict(_qwen3_config_from_hf(cfg, source), **_qwen_moe_fields_from_hf(cfg, source, "Qwen3"))


def _qwen2_moe_config_from_hf(cfg, source: str) -> dict:
    """Qwen2-MoE: Qwen2's attention (Q, K, V biases if ``qkv_bias``), Qwen's MoE layers, each with a shared expert
    of ``shared_expert_intermediate_size`` whose output is scaled by sigmoid(``shared_expert_gate``(x))."""
    if not getattr(cfg, "shared_expert_intermediate_size", 0):
        _refuse(source, "shared_expert_intermediate_size", cfg.shared_expert_intermediate_size,
                "a Qwen2-MoE layer with its shared expert")
    return dict(_qwen2_config_from_hf(cfg, source), **_qwen_moe_fields_from_hf(cfg, source, "Qwen2"),
                qkv_bias=bool(getattr(cfg, "qkv_bias", True)),
                moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, moe_shared_expert_gate=True)


# DeepSeek-V3's training settings that its config has no field for (docs/moe.md): the sequence-wise balancing loss
# with the paper's alpha, beside the auxiliary-loss-free bias (its gamma is the project's default rate)
DEEPSEEK_V3_TRAINING = dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4)


def _deepseek_v3_config_from_hf(cfg, source: str) -> dict:
    """DeepSeek-V3: latent attention (``q_lora_rank``, ``kv_lora_rank``, the head dims), the first
    ``first_k_dense_replace`` layers dense, the others ``n_routed_experts`` experts of ``moe_intermediate_size``
    chosen by sigmoid scores within the ``topk_group`` best of ``n_group`` groups, the selection moved by the
    balancing bias (``e_score_correction_bias``), weights renormalised if ``norm_topk_prob`` and scaled by
    ``routed_scaling_factor``, beside ``n_shared_experts`` shared experts (one MLP of n x the experts' width);
    ``num_mtp_layers`` prediction depths (those the files hold: ``from_hf``)."""
    if getattr(cfg, "attention_bias", False):
        _refuse(source, "attention_bias", True, "latent attention without biases")
    if not cfg.n_shared_experts:
        _refuse(source, "n_shared_experts", cfg.n_shared_experts, "a DeepSeek-V3 layer with its shared experts")
    groups = cfg.n_group if (cfg.n_group or 1) > 1 else None
    return dict(_decoder_config_from_hf(cfg, source), **DEEPSEEK_V3_TRAINING, bias=False,
                num_kv_heads=cfg.num_attention_heads, head_dim=cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                num_experts=cfg.n_routed_experts, moe_top_k=cfg.num_experts_per_tok,
                moe_ffn_hidden_size=cfg.moe_intermediate_size,
                moe_dense_layers=list(range(min(cfg.first_k_dense_replace or 0, cfg.num_hidden_layers))),
                moe_norm_topk_prob=bool(cfg.norm_topk_prob), moe_router_score_function="sigmoid",
                moe_router_num_groups=groups, moe_router_group_topk=cfg.topk_group if groups else None,
                moe_router_topk_scaling_factor=float(cfg.routed_scaling_factor), moe_router_enable_expert_bias=True,
                moe_shared_expert_intermediate_size=cfg.n_shared_experts * cfg.moe_intermediate_size,
                multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                v_head_dim=cfg.v_head_dim, mtp_num_layers=int(getattr(cfg, "num_mtp_layers", 0) or 0))


# -- the Hugging Face families -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face model family: its classes, its config's reader and writer, what of the project's
    config it cannot hold."""
    model_type: str
    variant: str                          # the project's GPT variant it maps to
    config_class: str                     # its transformers config class
    architecture: str                     # the causal-LM class an export names
    classifier: str                       # its *ForSequenceClassification (finetune.export_hf)
    base: str                             # the bare decoder class, whose weights import as well
    read: Callable[[Any, str], dict]      # (HF config, source) -> GPTConfig fields, refusing what it cannot hold
    write: Callable[[GPTConfig], dict]    # config -> the transformers config's fields (special tokens aside)
    holds: Callable[[GPTConfig], str | None]  # None, or what of the config the family cannot express
    experts: ExpertNames | None = None    # an MoE family's names of an MoE layer's tensors in its files

    @property
    def accepted(self) -> set[str]:
        return {self.architecture, self.base}


# DeepSeek-V3-generation settings (models/moe/router.py, models/deepseek.py) that change what the model computes and
# that none of the families below can express: their value in a config those families would otherwise export
LATER_GENERATION = {"moe_router_score_function": "softmax", "moe_router_num_groups": None,
                    "moe_router_group_topk": None, "moe_router_topk_scaling_factor": 1.0,
                    "moe_router_enable_expert_bias": False, "moe_shared_expert_intermediate_size": None,
                    "moe_shared_expert_gate": False, "multi_latent_attention": False, "mtp_num_layers": 0}


def _differs(c: GPTConfig, wanted) -> list[str]:
    """``field=value`` of each (field, value) of ``wanted`` that the config does not have."""
    return [f"{name}={getattr(c, name)!r}" for name, value in wanted if getattr(c, name) != value]


def _later_generation(c: GPTConfig) -> list[str]:
    return _differs(c, LATER_GENERATION.items())


def _qwen2_moe_holds(c: GPTConfig) -> str | None:
    """Qwen2-MoE: Qwen2's attention, Qwen's softmax routing, a gated shared expert in every MoE layer."""
    wanted = {**LATER_GENERATION, "moe_shared_expert_gate": True, "qk_norm": False, "bias": False,
              "sliding_window": None}
    del wanted["moe_shared_expert_intermediate_size"]  # any width (the gate needs one)
    lacks = _differs(c, wanted.items())
    return ", ".join(lacks + ([] if c.num_experts else ["num_experts=0"])) or None


def _deepseek_v3_holds(c: GPTConfig) -> str | None:
    """DeepSeek-V3: latent attention, sigmoid routing with the balancing bias, ungated shared experts n x the
    experts' width, the first layers dense (any group limit, scaling, renormalisation and MTP depths)."""
    lacks = _differs(c, (("multi_latent_attention", True), ("moe_router_score_function", "sigmoid"),
                         ("moe_router_enable_expert_bias", True), ("moe_shared_expert_gate", False),
                         ("qk_norm", False), ("qkv_bias", False), ("bias", False), ("sliding_window", None),
                         ("moe_layer_freq", 1)))
    if not c.num_experts:
        return ", ".join(lacks + ["num_experts=0"])
    if c.moe_dense_layers != list(range(len(c.moe_dense_layers))):
        lacks.append(f"moe_dense_layers={c.moe_dense_layers} (only the first layers dense: first_k_dense_replace)")
    shared, f = c.moe_shared_expert_intermediate_size, c.moe_ffn_hidden_size or c.ffn_hidden_size
    if shared is None or shared % f:
        lacks.append(f"moe_shared_expert_intermediate_size={shared} (n_shared_experts x the experts' {f})")
    return ", ".join(lacks) or None


def _holds(*, qkv_bias: bool = False, qk_norm: bool = False, sliding_window: bool = False, bias: bool = True,
           moe: bool = False, sparse_layers: bool = False):
    """A family's ``holds``: the settings of the config it cannot express, named as ``field=value``."""
    def problem(c: GPTConfig) -> str | None:
        lacks = _later_generation(c)
        if (c.qkv_bias and not c.bias) != qkv_bias:  # Qwen2 always has Q, K, V biases, the others never alone
            lacks.append(f"qkv_bias={c.qkv_bias}")
        if c.qk_norm != qk_norm:
            lacks.append(f"qk_norm={c.qk_norm}")
        if c.sliding_window is not None and not sliding_window:
            lacks.append(f"sliding_window={c.sliding_window}")
        if c.bias and not bias:
            lacks.append("bias=True")
        if bool(c.num_experts) != moe:
            lacks.append(f"num_experts={c.num_experts}")
        elif moe and not sparse_layers and (c.moe_layer_freq != 1 or c.moe_dense_layers or not c.moe_norm_topk_prob):
            lacks.append(f"moe_layer_freq={c.moe_layer_freq}, moe_dense_layers={c.moe_dense_layers}, "
                         f"moe_norm_topk_prob={c.moe_norm_topk_prob} (every layer MoE, top-k renormalised)")
        return ", ".join(lacks) or None
    return problem


HF_FAMILIES: dict[str, HFFamily] = {f.model_type: f for f in (
    HFFamily("gpt2", "gpt2", "GPT2Config", GPT2_ARCH, "GPT2ForSequenceClassification", "GPT2Model",
             _gpt2_config_from_hf, _gpt2_config_to_hf,
             lambda c: (f"num_experts={c.num_experts} (GPT-2 has no MoE layers)" if c.num_experts
                        else ", ".join(_later_generation(c)) or None)),
    HFFamily("llama", "llama", "LlamaConfig", LLAMA_ARCH, "LlamaForSequenceClassification", "LlamaModel",
             _llama_config_from_hf, _llama_config_to_hf, _holds()),
    HFFamily("qwen2", "llama", "Qwen2Config", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification", "Qwen2Model",
             _qwen2_config_from_hf, _qwen2_config_to_hf, _holds(qkv_bias=True, bias=False)),
    HFFamily("qwen3", "llama", "Qwen3Config", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification", "Qwen3Model",
             _qwen3_config_from_hf, _qwen3_config_to_hf, _holds(qk_norm=True, bias=False)),
    HFFamily("mistral", "llama", "MistralConfig", "MistralForCausalLM", "MistralForSequenceClassification",
             "MistralModel", _mistral_config_from_hf, _mistral_config_to_hf, _holds(sliding_window=True, bias=False)),
    HFFamily("mixtral", "llama", "MixtralConfig", "MixtralForCausalLM", "MixtralForSequenceClassification",
             "MixtralModel", _mixtral_config_from_hf, _mixtral_config_to_hf,
             _holds(sliding_window=True, bias=False, moe=True), MIXTRAL_EXPERTS),
    HFFamily("qwen3_moe", "llama", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification",
             "Qwen3MoeModel", _qwen3_moe_config_from_hf, _qwen3_moe_config_to_hf,
             _holds(qk_norm=True, bias=False, moe=True, sparse_layers=True), QWEN3_MOE_EXPERTS),
    HFFamily("qwen2_moe", "llama", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "Qwen2MoeForSequenceClassification",
             "Qwen2MoeModel", _qwen2_moe_config_from_hf, _qwen2_moe_config_to_hf, _qwen2_moe_holds,
             QWEN2_MOE_EXPERTS),
    HFFamily("deepseek_v3", "llama", "DeepseekV3Config", "DeepseekV3ForCausalLM",
             "DeepseekV3ForSequenceClassification", "DeepseekV3Model", _deepseek_v3_config_from_hf,
             _deepseek_v3_config_to_hf, _deepseek_v3_holds, DEEPSEEK_V3_EXPERTS),
)}
HF_ARCHITECTURE = {name: f.architecture for name, f in HF_FAMILIES.items()}


def hf_family(config: GPTConfig) -> HFFamily:
    """The family ``config`` exports as: the one it was imported from (``hf_model_type``), else the first of
    its variant's families that holds it (so a model trained here with ``qk_norm`` exports as Qwen3)."""
    if config.hf_model_type is not None:
        family = HF_FAMILIES.get(config.hf_model_type)
        if family is None or family.variant != config.variant:
            known = ", ".join(n for n, f in HF_FAMILIES.items() if f.variant == config.variant)
            raise ConversionError(f"hf_model_type {config.hf_model_type!r} is not a Hugging Face family of the "
                                  f"{config.variant} variant; choose one of {known}")
        problem = family.holds(config)
        if problem:
            raise ConversionError(f"the model cannot be exported as {family.architecture} (hf_model_type "
                                  f"{family.model_type!r}), which cannot hold {problem}")
        return family
    for family in HF_FAMILIES.values():
        if family.variant == config.variant and family.holds(config) is None:
            return family
    later = ", ".join(_later_generation(config))
    raise ConversionError(f"no Hugging Face family holds this {config.variant} model "
                          f"(qkv_bias={config.qkv_bias}, qk_norm={config.qk_norm}, bias={config.bias}, "
                          f"sliding_window={config.sliding_window}, num_experts={config.num_experts}"
                          f"{', ' + later if later else ''}); no "
                          f"transformers class computes it (docs/huggingface.md lists the families and what they "
                          f"hold)")


def state_dict_from_hf(hf_sd: Mapping[str, torch.Tensor], config: GPTConfig, dtype: torch.dtype | None = None,
                       source: str = "Hugging Face state dict", *, lazy: bool = False) -> dict:
    """The project's full state dict from a Hugging Face one (strict: every tensor used, every shape checked).

    ``lazy``: the values are ``PlannedTensor``s, each made (read, joined, cast) only when it is written, so an
    import from a ``SafetensorsFiles`` mapping holds one tensor at a time.
    """
    rules = weight_map(config)
    out, used = {}, set()
    for rule in rules:
        missing = [n for n in rule.theirs if n not in hf_sd]
        if missing:
            raise ConversionError(f"{source}: missing tensor(s) {', '.join(missing)} (for the project's {rule.ours})")
        shapes = [shape_of(hf_sd, n) for n in rule.theirs]
        shapes = [tuple(reversed(sh)) if rule.transpose else sh for sh in shapes]
        full = (sum(sh[0] for sh in shapes), *shapes[0][1:]) if shapes[0] else ()
        if (full != rule.shape or any(sh[1:] != shapes[0][1:] for sh in shapes)
                or (rule.split and [sh[0] for sh in shapes] != list(rule.split))):
            listed = ", ".join(f"{n} {shape_of(hf_sd, n)}" for n in rule.theirs)
            raise ConversionError(f"{source}: {listed} do(es) not fit the config (the project's {rule.ours} "
                                  f"must be {rule.shape})")
        out[rule.ours] = PlannedTensor(rule.shape, dtype or dtype_of(hf_sd, rule.theirs[0]),
                                       _joiner(hf_sd, rule, dtype))
        used.update(rule.theirs)
    if config.variant == "gpt2" and not config.bias:
        nonzero = [n for n in _gpt2_bias_names(config) if n in hf_sd and hf_sd[n].any()]
        if nonzero:
            raise ConversionError(f"{source}: the config has no biases but {nonzero[0]} is not zero")
        used.update(_gpt2_bias_names(config))
    tied_head = "lm_head.weight"
    if config.tie_embeddings and tied_head in hf_sd:
        # A tied model's state_dict() lists the shared tensor twice; a different one would be a different model.
        emb_name = "transformer.wte.weight" if config.variant == "gpt2" else "model.embed_tokens.weight"
        head, emb = hf_sd[tied_head], hf_sd[emb_name]
        if head.data_ptr() != emb.data_ptr() and not torch.equal(head, emb):
            raise ConversionError(f"{source}: tie_word_embeddings is true but lm_head.weight differs from the "
                                  f"input embedding")
        del head, emb
        used.add(tied_head)
    used.update(_mtp_copies(hf_sd, config, source))
    unexpected = sorted((k for k in hf_sd if k not in used and not _ignorable(k)), key=_natural)
    if unexpected:
        raise ConversionError(f"{source}: tensor(s) the project's model has no place for: "
                              f"{', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    return out if lazy else {name: planned.make() for name, planned in out.items()}


def _mtp_copies(hf_sd: Mapping, config: GPTConfig, source: str) -> list[str]:
    """The embedding and output layer a DeepSeek-V3 checkpoint repeats in each prediction depth: equal to the
    model's (the project's depths share them), or refused."""
    head = "model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"
    found = []
    for d in range(config.mtp_num_layers):
        for leaf, main in (("embed_tokens.weight", "model.embed_tokens.weight"), ("shared_head.head.weight", head)):
            name = f"model.layers.{config.num_layers + d}.{leaf}"
            if name not in hf_sd:
                continue
            if not torch.equal(materialize(hf_sd[name]), materialize(hf_sd[main])):
                raise ConversionError(f"{source}: {name} differs from {main}; the project's multi-token prediction "
                                      f"shares the model's embedding and output layer")
            found.append(name)
    return found


def mtp_depths_found(config: GPTConfig, hf_sd: Mapping) -> GPTConfig:
    """``config`` with the prediction depths whose weights ``hf_sd`` holds: DeepSeek-V3's config names
    ``num_mtp_layers`` whether or not its files hold them (``save_pretrained`` writes none)."""
    depths = 0
    while depths < config.mtp_num_layers and f"model.layers.{config.num_layers + depths}.eh_proj.weight" in hf_sd:
        depths += 1
    return config if depths == config.mtp_num_layers else dataclasses.replace(config, mtp_num_layers=depths)


def _joiner(hf_sd: Mapping, rule: WeightRule, dtype):
    def make() -> torch.Tensor:
        pieces = [materialize(hf_sd[n]) for n in rule.theirs]
        pieces = [p.t() if rule.transpose else p for p in pieces]
        full = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        full = deinterleave_rope_rows(full.contiguous(), *rule.rope) if rule.rope else full
        return _cast(full.detach().contiguous(), dtype, rule.theirs[0])
    return make


def _ignorable(name: str) -> bool:
    # Buffers old checkpoints saved: GPT-2's causal-mask constants, Llama's RoPE frequencies.
    return name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq"))


# -- loading Hugging Face models from disk -----------------------------------------------------------------------------

@dataclass(frozen=True)
class HFSource:
    """Where a Hugging Face model lives: a directory, and optionally a GGUF file in it."""
    directory: Path
    gguf_file: str | None = None

    def __str__(self):
        return str(self.directory / self.gguf_file) if self.gguf_file else str(self.directory)

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


GGUF_MIN_TENSOR_INFO = 24  # name length u64, n_dims u32, type u32, offset u64 (an empty name, no dims)
GGUF_MIN_KV = 13  # key length u64, value type u32, a value of one byte


def check_gguf(path: Path) -> Path:
    """The fixed header of a GGUF file (magic, version, tensor and key counts), refused in one line when cut or
    when its counts cannot fit the file: the gguf reader would raise from deep inside, or loop over 2^40
    entries."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        what = "not a GGUF file (no GGUF magic)" if head[:4] != b"GGUF" else f"cut inside its header ({size} bytes)"
        raise ConversionError(f"{path}: {what}; give a complete .gguf file")
    version, tensors, keys = struct.unpack("<IQQ", head[4:])
    if version not in (2, 3):
        raise ConversionError(f"{path}: GGUF version {version}, not 2 or 3; give a file of a current llama.cpp")
    if tensors * GGUF_MIN_TENSOR_INFO + keys * GGUF_MIN_KV > size - 24:
        raise ConversionError(f"{path}: its header declares {tensors} tensors and {keys} keys, more than its "
                              f"{size} bytes can hold (damaged or cut); give a complete .gguf file")
    return path


def check_weight_headers(directory: Path) -> None:
    """Every safetensors header of a model directory read and checked (offsets past the end of the file, shapes
    whose bytes overflow): one line naming the file, before a loader that would panic or map garbage."""
    for path in hf_weight_files(directory) or []:
        read_header(path)


def resolve_hf_source(path: str | Path, gguf_file: str | None = None) -> HFSource:
    """A model directory, a ``.gguf`` file, or a directory holding one ``.gguf`` file and no config.json (a GGUF
    file's header checked: ``check_gguf``)."""
    source = _resolve_hf_source(path, gguf_file)
    if source.gguf_file and (source.directory / source.gguf_file).is_file():
        check_gguf(source.directory / source.gguf_file)
    return source


def _resolve_hf_source(path: str | Path, gguf_file: str | None = None) -> HFSource:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Hugging Face model {path} does not exist")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ConversionError(f"{path} is a file but not a .gguf file; give a model directory or a .gguf file")
        return HFSource(path.parent, path.name)
    if gguf_file:
        return HFSource(path, gguf_file)
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return HFSource(path, ggufs[0])
        raise ConversionError(f"{path} has no config.json" + (f" and several .gguf files ({', '.join(ggufs)}): "
                                                               f"name one" if ggufs else ""))
    return HFSource(path)


def load_hf_config(source: HFSource):
    # transformers only where a Hugging Face object is built (see hf_config)
    from transformers import AutoConfig  # noqa: PLC0415
    try:
        return AutoConfig.from_pretrained(str(source.directory), trust_remote_code=False, **source.kwargs())
    except (OSError, ValueError, KeyError) as e:
        raise ConversionError(f"{source}: not a loadable Hugging Face model config: {e}") from None


def load_hf_model(source: HFSource, dtype: torch.dtype = torch.float32):
    """The Hugging Face causal LM at ``source`` (GGUF tensors are dequantised by transformers' loader)."""
    # transformers only where a Hugging Face object is built (see hf_config)
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    config_from_hf(load_hf_config(source), str(source))  # refuse before reading gigabytes of weights
    if not source.gguf_file:
        check_weight_headers(source.directory)
    model, info = AutoModelForCausalLM.from_pretrained(str(source.directory), dtype=dtype, trust_remote_code=False,
                                                       output_loading_info=True, **source.kwargs())
    missing = [k for k in info.get("missing_keys", [])
               if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing:
        raise ConversionError(f"{source}: the checkpoint lacks weight(s) {', '.join(sorted(missing)[:8])}; "
                              f"transformers would initialise them randomly")
    return model.eval()


def from_hf(hf_model_or_dir, *, gguf_file: str | None = None, dtype: torch.dtype | str | None = torch.float32,
            source: str | None = None, lazy: bool = False):
    """(GPTConfig, full state dict) of a Hugging Face causal LM of one of ``HF_FAMILIES``.

    ``hf_model_or_dir`` is a loaded model, a model directory, or a ``.gguf`` file. ``dtype`` is the
    dtype of the returned tensors (None keeps a loaded model's; a directory's are read as float32). ``source``
    names the model in messages and in ``config.extra["hf"]["source"]``. A directory of safetensors files is
    read tensor by tensor, without building the Hugging Face model (with ``lazy``, the values are
    ``PlannedTensor``s made one at a time as they are written: an import never holds two copies of the model);
    GGUF files and torch ``.bin`` weights go through transformers' loader.
    """
    dtype = parse_dtype(dtype)
    if isinstance(hf_model_or_dir, (str, Path)):
        resolved = resolve_hf_source(hf_model_or_dir, gguf_file)
        name = source or str(resolved)
        files = None if resolved.gguf_file else hf_weight_files(resolved.directory)
        if files is not None:
            config = config_from_hf(load_hf_config(resolved), name)
            hf_sd = _with_base_prefix(SafetensorsFiles(files), config)
            dtype = dtype or torch.float32
        else:
            model = load_hf_model(resolved, dtype or torch.float32)
            config, hf_sd = config_from_hf(model.config, name), model.state_dict()
    else:
        model = hf_model_or_dir
        name = source or getattr(model.config, "_name_or_path", None) or type(model).__name__
        config, hf_sd = config_from_hf(model.config, name), model.state_dict()
    if config.num_experts and is_fused(hf_sd):  # a loaded transformers 5 MoE
        hf_sd = unfuse_experts(hf_sd, hf_family(config).experts)
    config = mtp_depths_found(config, hf_sd)
    if config.variant == "gpt2" and not config.bias and any(hf_sd[n].any() for n in _gpt2_bias_names(config)
                                                            if n in hf_sd):
        config = dataclasses.replace(config, bias=True)  # exported bias-free, then trained with biases
    return config, state_dict_from_hf(hf_sd, config, dtype, source=name, lazy=lazy)


class _Prefixed(Mapping):
    """A base model's file (``wte.weight``, ``embed_tokens.weight``) seen with the causal LM's names
    (``transformer.wte.weight``, ``model.embed_tokens.weight``), as transformers' loader sees it."""

    def __init__(self, files: SafetensorsFiles, prefix: str):
        self.files, self.prefix = files, prefix
        self.names = {(k if k.startswith("lm_head.") else prefix + k): k for k in files}

    def __getitem__(self, name):
        return self.files[self.names[name]]

    def shape_of(self, name):
        return self.files.shape_of(self.names[name])

    def dtype_of(self, name):
        return self.files.dtype_of(self.names[name])

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def _with_base_prefix(files: SafetensorsFiles, config: GPTConfig) -> Mapping:
    prefix = "transformer." if config.variant == "gpt2" else "model."
    if any(k.startswith(prefix) for k in files):
        return files
    return _Prefixed(files, prefix)


def num_parameters_message(config: GPTConfig) -> str:
    n = config.num_parameters()
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit} parameters"
    return f"{n} parameters"


def parallel_sizes(config: GPTConfig) -> list[int]:
    """Tensor-parallel sizes that divide the model (every head count and the MLP width)."""
    g = math.gcd(math.gcd(config.num_heads, config.num_kv_heads), config.ffn_hidden_size)
    return [d for d in range(1, g + 1) if g % d == 0]
