"""The llama variant's side of every Llama-derived family (Llama, Qwen2/3, Mistral, Mixtral, Qwen-MoE,
DeepSeek-V3): its tensor names (dense, MoE and latent-attention layers, multi-token prediction depths) and the
config fields and refusals the families share.
"""
from __future__ import annotations

from collections.abc import Callable

from models.config import GPTConfig
from pipeline.hf.architectures.base import ConversionError, WeightLayout, WeightRule, refuse
from pipeline.hf.experts import ExpertNames


def _llama_map(c: GPTConfig, experts: Callable[[], ExpertNames]) -> list[WeightRule]:
    h, V = c.hidden_size, c.vocab_size
    R = WeightRule
    rules = [R("embedding.word_embeddings.weight", (V, h), ("model.embed_tokens.weight",))]
    for i in range(c.num_layers):
        rules += _layer_rules(c, f"layers.{i}.", f"model.layers.{i}.", c.is_moe_layer(i), experts)
    rules.append(R("final_norm.norm.weight", (h,), ("model.norm.weight",)))
    if not c.tie_embeddings:
        rules.append(R("lm_head.weight", (V, h), ("lm_head.weight",)))
    for d in range(c.mtp_num_layers):
        p, t = f"mtp.layers.{d}.", f"model.layers.{c.num_layers + d}."
        rules += [R(p + "enorm.weight", (h,), (t + "enorm.weight",)),
                  R(p + "hnorm.weight", (h,), (t + "hnorm.weight",)),
                  R(p + "eh_proj.weight", (h, 2 * h), (t + "eh_proj.weight",)),
                  R(p + "final_norm.weight", (h,), (t + "shared_head.norm.weight",))]
        # an MoE layer where the model has experts
        rules += _layer_rules(c, p + "block.", t, c.num_experts > 0, experts)
    return rules


def _layer_rules(c: GPTConfig, p: str, t: str, moe: bool, experts: Callable[[], ExpertNames]) -> list[WeightRule]:
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
        rules += _expert_rules(c, p, t, experts)
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


def _expert_rules(c: GPTConfig, p: str, t: str, experts: Callable[[], ExpertNames]) -> list[WeightRule]:
    """An MoE layer's router and experts (DeepSpeed's names: ``mlp.moe.deepspeed_moe``) and their names in the
    files of the config's Hugging Face family (``pipeline.hf.experts``)."""
    h, f, E = c.hidden_size, c.moe_ffn_hidden_size or c.ffn_hidden_size, c.num_experts
    names, ours = experts(), p + "mlp.moe.deepspeed_moe."
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


def decoder_config_to_hf(config: GPTConfig) -> dict:
    """The config fields Llama, Qwen2, Qwen3 and Mistral share."""
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings, initializer_range=config.init_std,
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
        attention_dropout=config.attention_dropout)


def rope_theta(cfg, source: str) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    if getattr(cfg, "rope_scaling", None) and not rope:  # transformers 4.x configs
        rope = dict(cfg.rope_scaling)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        refuse(source, "rope_type", rope_type, "plain RoPE without scaling (rope_type 'default')")
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        refuse(source, "partial_rotary_factor", partial, "RoPE over the whole head")
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise ConversionError(f"{source}: no rope_theta in the config")
    return float(theta)


def decoder_config_from_hf(cfg, source: str) -> dict:
    """The fields Llama, Qwen2, Qwen3 and Mistral configs share, as the project's llama variant."""
    if cfg.hidden_act != "silu":
        refuse(source, "hidden_act", cfg.hidden_act, "SwiGLU with silu")
    return dict(variant="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                ffn_hidden_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
                norm_eps=float(cfg.rms_norm_eps), rope_theta=rope_theta(cfg, source), hidden_dropout=0.0,
                attention_dropout=float(cfg.attention_dropout or 0.0), init_std=float(cfg.initializer_range),
                tie_embeddings=bool(cfg.tie_word_embeddings))


def full_attention_only(cfg, source: str) -> None:
    """Qwen's sliding window applies to some layers only: refused (Mistral's one window is ``sliding_window``)."""
    if getattr(cfg, "use_sliding_window", False):
        refuse(source, "use_sliding_window", True, "full causal attention in every layer")
    partial = [t for t in getattr(cfg, "layer_types", None) or [] if t != "full_attention"]
    if partial:
        refuse(source, "layer_types", partial[0], "full causal attention in every layer")


def qwen_moe_fields_to_hf(config: GPTConfig) -> dict:
    """The MoE fields Qwen3-MoE and Qwen2-MoE share."""
    return dict(moe_intermediate_size=config.moe_ffn_hidden_size or config.ffn_hidden_size,
                num_experts=config.num_experts, num_experts_per_tok=config.moe_top_k,
                norm_topk_prob=config.moe_norm_topk_prob, decoder_sparse_step=config.moe_layer_freq,
                mlp_only_layers=list(config.moe_dense_layers), router_aux_loss_coef=config.moe_aux_loss_coeff)


def qwen_moe_fields_from_hf(cfg, source: str, dense: str) -> dict:
    """The MoE fields Qwen3-MoE and Qwen2-MoE share: every ``decoder_sparse_step``-th layer not in
    ``mlp_only_layers`` a mixture of ``num_experts`` SwiGLU experts of ``moe_intermediate_size`` (softmax, top-k,
    renormalised if ``norm_topk_prob``; dropless), the others a dense SwiGLU of ``intermediate_size``."""
    if not cfg.num_experts:
        refuse(source, "num_experts", cfg.num_experts, f"an MoE model (import a dense model as {dense})")
    return dict(num_experts=cfg.num_experts, moe_top_k=cfg.num_experts_per_tok,
                moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_aux_loss_coeff=float(cfg.router_aux_loss_coef),
                moe_norm_topk_prob=bool(cfg.norm_topk_prob), moe_layer_freq=cfg.decoder_sparse_step,
                moe_dense_layers=list(cfg.mlp_only_layers or []))


WEIGHTS = WeightLayout(_llama_map, "model.", "model.embed_tokens.weight")
